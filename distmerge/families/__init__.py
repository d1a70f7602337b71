"""Model families: name and layout rules as tables, turned into units of work for the engine (see base.py).

Registration: a family module calls `register(...)` on its instance; the import below makes it known.
Which family takes a checkpoint is decided by `base.claim`, in each family's declared order.
"""

from distmerge.families import hf, lora, megatron, quantized, torchtitan, value_head  # noqa: F401
