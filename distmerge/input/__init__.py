"""The input side: the walk of the input tree (tree), positional reads (reader), each rank's discovery
of its files (discover), object-store inputs (objects) and their batched ranged reads (reads).
"""
