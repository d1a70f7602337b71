"""Megatron-LM names and layouts: the family (family), its tables (tables), multi-latent attention (mla),
multi-token prediction layers (mtp).
"""
