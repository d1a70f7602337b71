"""The --quantize schemes, one table: each row's math lives in its module (fp8.py, fp4.py), and every row answers the
same questions, which table.py asks without naming a scheme:

    takes(shape)          can a weight of this shape be written so (4-bit: whole groups of input elements)
    parts(name, shape)    the tensors it becomes: (name, shape, safetensors code) each, the quantized weight first
    fused                 do the weights vLLM fuses (fused.py) share a scale; shared(weights): that scale
    quantize(w, shared)   those tensors' values, from the weight in its output dtype
    layout                one line for notes and --help

Adding a scheme is a row of its module's SCHEMES (and its config below, when it is not compressed-tensors' preset).
"""

from __future__ import annotations

from dataclasses import dataclass

from distmerge.quantize import fp4, fp8

Scheme = fp8.Scheme | fp4.Scheme
SCHEMES: dict[str, Scheme] = {**fp8.SCHEMES, **fp4.SCHEMES}
# The schemes whose config.json is compressed-tensors' (its classes write it: the `fp8` extra)
COMPRESSED_TENSORS = ("fp8-channel", *fp4.SCHEMES)


@dataclass(frozen=True, kw_only=True)
class Quantized:
    """What the plan says about a quantized output: the scheme, and the modules whose weights stay in the merge's
    dtype (2-D weights the family table leaves alone or the scheme cannot take, and heads the model re-creates from
    a tied embedding)."""

    scheme: str
    unconverted: tuple[str, ...]

    def config(self) -> dict:
        """config.json's quantization_config (compressed-tensors' through its own classes: imported only here)."""
        if self.scheme == "fp8-block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(fp8.BLOCK), "modules_to_not_convert": list(self.unconverted)}
        from distmerge.quantize import fp8_compressed

        if self.scheme in fp4.SCHEMES:
            row = fp4.SCHEMES[self.scheme]
            return fp8_compressed.preset_config(row.preset, row.format, list(self.unconverted))
        return fp8_compressed.config(list(self.unconverted))


def scheme_of(config: dict) -> Scheme | None:
    """The scheme of a folder's config.json quantization_config, when it is one distmerge writes."""
    return fp8.scheme_of(config) or fp4.scheme_of(config)
