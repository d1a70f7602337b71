"""The input side: the Source protocol every read of a checkpoint goes through (source), a folder as a source (local,
walked once: tree), an object store as a source (s3), and the read policies of a round's reads (reads).
"""
