"""Input layouts. Each module answers: is this my layout, which files, which fragments (see base.py).

Registration: a format module decorates its class with `@register`; the import below makes it known.
"""

from distmerge.formats import fsdp, torchtitan  # noqa: F401
from distmerge.formats.dcp import folder as dcp  # noqa: F401
from distmerge.formats.dcp import hf_writer as dcp_hf  # noqa: F401
from distmerge.formats.deepspeed import folder as deepspeed  # noqa: F401
from distmerge.formats.megatron import dist as megatron_dist  # noqa: F401
from distmerge.formats.megatron import legacy as megatron_legacy  # noqa: F401
