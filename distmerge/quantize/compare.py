"""verify's side of the quantize part: which scheme a model's weights are stored in, found from its config.json or
from the plan that will write it. The scheme answers the rest (scheme.py): which stored tensors are encoded
(`stored`), each weight's decoder with its bound per element (`decoder`), how transformers loads the folder (`load`).

verifier/listing.py asks `encoding_of` and puts the answer in its Listing; verifier/bounded.py compares a weight with
its decoder and never names a scheme. The bounds, per element (fp8.bound, fp4.bound):

    FP8   |q * scale - reference| <= 2^-4 |reference| + 2^-10 scale
    FP4   |value x scale - reference| <= max(|reference|, scale) / 4   (e2m1 keeps one mantissa bit)

each plus the cast to the model's dtype when the reference is wider (bf16 adds 2^-9 |reference|: `cast_unit`). The
scales are small (one per row, per 128 x 128 block, or per 16 or 32 inputs) and are held whole, copied, as float32:
each element of a block finds its own scale by its row and column (FP8), or its group (4-bit: the groups tile each
row, whose columns are a whole number of groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distmerge.quantize import schemes
from distmerge.quantize.scheme import Scheme

Encoding = Scheme  # what verify calls a scheme: how the merged model's weights are encoded


def encoding_of(config: dict[str, Any], later: Mapping[str, object] | None = None) -> Scheme | None:
    """The encoding of a model's weights: what its config.json's quantization_config says, or, for a model not yet
    written (verify of a checkpoint merged in memory), the record finalize would make it from (`later`:
    Plan.config_later)."""
    made = (later or {}).get("quantization_config")
    if isinstance(made, schemes.Quantized):
        return schemes.scheme(made.scheme)
    return schemes.scheme_of(config)
