"""Input layouts. Each module answers: is this my layout, which files, which fragments (see base.py).

Registration: a format module decorates its class with `@register`; the import below makes it known.
"""

from distmerge.formats import dcp, dcp_hf, deepspeed, fsdp, megatron_dist, megatron_legacy, torchtitan  # noqa: F401
