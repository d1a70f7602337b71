"""Input layouts. Each module answers: is this my layout, which files, which fragments (see base.py).

Registration: a format module decorates its class with `@register`; the import below makes it known.
"""

# Plain imports: an alias here (`folder as dcp`) would put the module where the package `distmerge.formats.dcp` is.
import distmerge.formats.dcp.folder  # noqa: F401
import distmerge.formats.dcp.hf_writer  # noqa: F401
import distmerge.formats.deepspeed.folder  # noqa: F401
import distmerge.formats.fsdp  # noqa: F401
import distmerge.formats.megatron.dist  # noqa: F401
import distmerge.formats.megatron.legacy  # noqa: F401
import distmerge.formats.torchtitan  # noqa: F401
