"""torchtitan names and layouts: the family (family) and its tables (tables).
"""
