"""Input layouts. Each module answers: is this my layout, which files, which fragments (see base.py).

A format module defines its class and registers nothing; registry.py lists every format (FORMATS) and is where
detection, --format, --help and the format options read them from.
"""
