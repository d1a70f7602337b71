"""DeepSpeed ZeRO 0-3 saves: the format (folder), the layouts of its partitions (layout, zero).
"""
