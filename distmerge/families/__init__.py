"""Model families: name and layout rules as tables, turned into units of work for the engine (see base.py).

Each family module defines its instance (hf.HF, lora.family.LORA_FAMILY, megatron.family.MEGATRON,
torchtitan.family.TORCHTITAN, value_head.VALUE_HEAD); distmerge/catalog.py lists them with every transform and
registers them, once, before the first claim. Which family takes a checkpoint is decided by `base.claim`, in each
family's declared order.
"""
