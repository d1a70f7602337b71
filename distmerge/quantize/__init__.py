"""The quantize part: which weights an output quantizes and how their bytes and config are made.

    fp8.py             FP8 (e4m3) weights, per channel or in 128x128 blocks, with their scales
    fp8_compressed.py  config.json's quantization_config, by compressed-tensors' own classes (the `fp8` extra)
    table.py           which weights a family quantizes (attention and MLP linear layers; never embeddings, norms,
                       routers, lm_head): a family table of its own
(verifier/fp8_compare.py judges a quantized weight against its reference.)
"""
