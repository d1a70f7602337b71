"""Which input layouts exist, and how one is picked for a folder."""

from __future__ import annotations

from pathlib import Path

from distmerge.errors import InputError
from distmerge.formats import megatron_layout
from distmerge.formats.base import InputFormat
from distmerge.formats.dcp import DcpFormat
from distmerge.formats.dcp_hf import DcpHfFormat
from distmerge.formats.fsdp import FsdpFormat
from distmerge.formats.megatron_dist import MegatronDistFormat
from distmerge.formats.megatron_legacy import MegatronLegacyFormat

# Detection order: the first format whose detect() says yes (Megatron's torch_dist is a DCP folder too).
FORMATS: dict[str, InputFormat] = {
    f.name: f for f in (FsdpFormat(), MegatronLegacyFormat(), MegatronDistFormat(), DcpFormat(), DcpHfFormat())
}


def warm_up(root: Path, requested: str = "auto") -> None:
    """Import what the input's format needs before the merge's clock starts (DTensor costs ~0.8 s).
    Errors are left to discovery, which reports them properly."""
    try:
        fmt = pick(root, requested)
    except (InputError, OSError):
        return
    if hasattr(fmt, "warm_up"):
        fmt.warm_up()


def pick(root: Path, requested: str = "auto") -> InputFormat:
    if requested != "auto":
        if requested not in FORMATS:
            raise InputError(f"unknown format {requested!r}; known: {', '.join(FORMATS)}")
        return FORMATS[requested]
    for fmt in FORMATS.values():
        if fmt.detect(root):
            return fmt
    if megatron_layout.RANK_DIR.match(root.name):
        raise InputError(f"{root} is one rank's folder of a Megatron save: pass the folder that holds the "
                         "mp_rank_* folders (or the checkpoint folder above it)")
    listing = sorted(p.name for p in root.iterdir())[:8]
    raise InputError(
        f"{root} is not a checkpoint distmerge recognises (found: {', '.join(listing) or 'nothing'}); "
        f"known formats: {', '.join(FORMATS)}"
    )
