"""Model families: name and layout rules as tables, turned into units of work for the engine (see base.py).

Registration: a family module calls `register(...)` on its instance; the import below makes it known.
Which family takes a checkpoint is decided by `base.claim`, in each family's declared order.
"""

# Plain imports: an alias here (`family as lora`) would put the module where the package `distmerge.families.lora` is.
import distmerge.families.hf  # noqa: F401
import distmerge.families.lora.family  # noqa: F401
import distmerge.families.megatron.family  # noqa: F401
import distmerge.families.torchtitan.family  # noqa: F401
import distmerge.families.value_head  # noqa: F401
import distmerge.quantize.table  # noqa: F401
