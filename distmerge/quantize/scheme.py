"""What every `--quantize` scheme is: one object that answers every question the merge, finalize, verify and the
command line ask of it, so that none of them names a scheme. Its module holds its math; schemes.py registers it.

    asked by                     what it answers
    the command line             name (the --quantize choice), description (one line of --help)
    table.py (plan, assemble)    takes(shape), parts(name, shape), fused, shared(weights), quantize(weight, shared)
    finalize (rank 0)            config(unconverted): config.json's quantization_config;
                                 announced(dtype): the dtype config.json names, the one its loader runs the model in
    table.py (planning)          require(): refuses before anything is written when a library it needs is missing
    verify (compare.py)          recognises(quant), stored(codes), decoder(shape, parts, device) with its decode and
                                 limit (the bound per element), loader(transformers), loaded, logits_cosine

A scheme that leaves one of the abstract methods out cannot be made (Python refuses to instantiate it), so a new one
never falls back on another's config.json.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from distmerge import dtypes
from distmerge.errors import DistmergeError

if TYPE_CHECKING:
    import torch

Take = Callable[..., "torch.Tensor"]  # take(slot, n, dtype=float32): a scratch buffer of n elements (blocks.Scratch)
Part = tuple[str, tuple[int, ...], str]  # a tensor a weight becomes: (name, shape, safetensors code)
LOGITS_COSINE = 0.99  # verify --logits without a tolerance given: the logits' cosine with the full-precision model's
# must reach this (docs/quantize.md: 0.9972 at worst on the test fixtures, tiny random models)
INSTALL = "pip install 'distmerge[quantize]'"  # the extra that holds what the schemes' configs and loaders need


class Decoder(Protocol):
    """One stored weight's decoding, block by block (verifier/bounded.py runs it)."""

    kind: str  # what verify's record says the weight is ("FP8", "FP4")
    dtype: str  # the stored weight's safetensors code
    per: int  # reference elements per stored element

    def decode(self, start: int, q: torch.Tensor, n: int, take: Take) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements [start, start + n) of the weight dequantized in float32, and each one's scale."""
        ...

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: Take) -> torch.Tensor:
        """The largest |decoded - reference| the recipe allows per element."""
        ...


class Scheme(ABC):
    """A --quantize scheme. Subclasses are frozen dataclasses whose fields say what is theirs (name, description
    and what their math needs) and which fill in every abstract method."""

    name: str  # the --quantize choice
    description: str  # one line: what it writes, for --help and the merge's note
    bits: str  # what its weights are, in a few words ("FP8", "4-bit"): verify --logits' note
    library: str | None = None  # the module its config and its loader need ("compressed_tensors"), None: none
    logits_cosine: float = LOGITS_COSINE

    @property
    def fused(self) -> bool:
        """Whether the weights vLLM fuses (fused.py) share a scale (then `shared` makes it)."""
        return False

    @abstractmethod
    def takes(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of this shape can be written so."""

    @abstractmethod
    def parts(self, name: str, shape: tuple[int, ...]) -> list[Part]:
        """The tensors weight `name` of `shape` becomes, the quantized weight first."""

    def shared(self, weights: list[torch.Tensor]) -> torch.Tensor | None:
        """The scale the weights of a fused set share (made from their extremes), None when the scheme has none."""
        return None

    @abstractmethod
    def quantize(self, weight: torch.Tensor, shared: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The values of `parts`' tensors, from the weight in its output dtype, on its device."""

    @abstractmethod
    def config(self, unconverted: list[str]) -> dict[str, Any]:
        """config.json's quantization_config, with `unconverted` the Linear modules kept in the merge's dtype."""

    def announced(self, dtype: str | None) -> str | None:
        """The dtype config.json names when the unquantized tensors are in `dtype`: the one a plain
        from_pretrained runs the model in, which must be the one its loader decodes the weights into."""
        return dtype

    @abstractmethod
    def recognises(self, quant: Mapping[str, Any]) -> bool:
        """Whether a folder's quantization_config is the one this scheme writes."""

    @abstractmethod
    def stored(self, codes: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """`codes`: a side's tensors, name -> safetensors code. The quantized weights with the tensors they are
        decoded with: stored name -> the verifier Pair's fields (`parts`, `per`), and stored name -> the weight's own
        name where the two differ."""

    @abstractmethod
    def decoder(self, shape: tuple[int, ...], parts: list[torch.Tensor], device: torch.device) -> Decoder:
        """One weight's decoder; `shape`: the reference's, `parts`: the tensors `stored` named, in its order."""

    @abstractmethod
    def loader(self, transformers: Any) -> Any:
        """The transformers quantization config class that loads this scheme's folders (its `from_dict`)."""

    @property
    def loaded(self) -> str:
        """verify --logits' note: how the merged model's weights became the ones it ran."""
        return f"{self.bits} weights ({self.name}) dequantized by transformers as it loads them"

    def require(self) -> None:
        """Refuses (at planning, on every rank, before anything is written) when the library its config needs is
        missing."""
        if self.library and importlib.util.find_spec(self.library) is None:
            raise DistmergeError(f"--quantize {self.name} needs the {self.library} module (its config.json is made "
                                 f"and loaded by it): {INSTALL}")

    def cast_unit(self, model: str | None, reference: str) -> float:
        """The unit roundoff of the cast of the weight to the model's dtype `model` before it was quantized, when
        narrower than the reference's (bf16: 2^-9), else 0."""
        narrower = model is not None and dtypes.itemsize(model) < dtypes.itemsize(reference)
        return unit_roundoff(model) if narrower else 0.0

    def load(self, auto_class: Any, folder: Path, transformers: Any) -> Any:
        """The model dequantized by transformers as it loads it, on any device: without a GPU it does so by itself;
        with one it would keep quantized modules, whose weights a reference could not load into. The folder's own
        quantization_config, with transformers' `dequantize` set."""
        quant = {**json.loads((folder / "config.json").read_text())["quantization_config"], "dequantize": True}
        with warnings.catch_warnings():  # "the model's own quantization_config will be used": what is wanted
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return auto_class.from_pretrained(folder, quantization_config=self.loader(transformers).from_dict(quant))


def unit_roundoff(code: str) -> float:
    """Half the spacing of the floating dtype at 1 (bf16 2^-9, fp16 2^-11, fp32 2^-24)."""
    mantissa = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52}.get(code)
    return 0.0 if mantissa is None else 2.0 ** -(mantissa + 1)
