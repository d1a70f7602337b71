"""Model families: name and layout rules as tables, turned into units of work for the engine (see base.py).

Registration: a family module calls `register(...)` on its instance; the import below makes it known.
Which family takes a checkpoint is decided by `base.claim`, in each family's declared order.
"""

from distmerge.families import hf, quantized, value_head  # noqa: F401
from distmerge.families.lora import family as lora  # noqa: F401
from distmerge.families.megatron import family as megatron  # noqa: F401
from distmerge.families.torchtitan import family as torchtitan  # noqa: F401
