"""LoRA runs: the family (family) and what it shares with the other families (base).
"""
