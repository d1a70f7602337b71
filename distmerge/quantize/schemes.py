"""The --quantize registry: every scheme, one line each. The command line's choices and help, the merge (table.py),
finalize's config.json and verify (compare.py) all read it; none names a scheme (scheme.py: what each answers).

Adding a scheme is a module with its `scheme.Scheme` subclass and its object (as fp8.py and fp4.py hold theirs), and
its line below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distmerge.errors import InputError
from distmerge.quantize import fp4, fp8
from distmerge.quantize.scheme import Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    fp8.FP8_BLOCK,
    fp8.FP8_CHANNEL,
    fp4.NVFP4,
    fp4.MXFP4,
)}


def choices() -> dict[str, str]:
    """Each --quantize choice and its line of --help (what it writes; the library it needs, if any)."""
    return {name: s.description + (" (needs the quantize extra)" if s.library else "") for name, s in SCHEMES.items()}


def scheme(name: str) -> Scheme:
    """The scheme registered as `name`, or one line naming the choices."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise InputError(f"--quantize {name!r}: no such scheme (choose one of {', '.join(SCHEMES)})") from None


def scheme_of(config: Mapping[str, Any]) -> Scheme | None:
    """The scheme whose quantization_config a folder's config.json holds, when it is one distmerge writes."""
    quant = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(quant, Mapping):
        return None
    return next((s for s in SCHEMES.values() if s.recognises(quant)), None)


@dataclass(frozen=True, kw_only=True)
class Quantized:
    """What the plan says about a quantized output: the scheme, and the modules whose weights stay in the merge's
    dtype (2-D weights the family table leaves alone or the scheme cannot take, and heads the model re-creates from
    a tied embedding). finalize asks it, on rank 0, for config.json's quantization_config and dtype."""

    scheme: str
    unconverted: tuple[str, ...]

    def config(self) -> dict[str, Any]:
        """config.json's quantization_config: the scheme's own (compressed-tensors' are made by its classes, imported
        only then)."""
        return scheme(self.scheme).config(list(self.unconverted))

    def dtype(self, main: str | None) -> str | None:
        """The dtype config.json names when most unquantized bytes are in `main`: the one its loader runs in."""
        return scheme(self.scheme).announced(main)
