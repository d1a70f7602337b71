"""Megatron-LM: legacy mp_rank_* files (legacy), torch_dist folders (dist), the TP/PP/EP grid (grid),
the layouts of its fused tensors (layout).
"""
