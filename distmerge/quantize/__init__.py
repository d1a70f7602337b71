"""The quantize part: which weights an output quantizes and how their bytes and config are made.

    fp8.py             FP8 (e4m3) weights, per channel or in 128x128 blocks, with their scales
    fp8_compressed.py  config.json's quantization_config, by compressed-tensors' own classes (the `fp8` extra)
    table.py           which weights a family quantizes (attention and MLP linear layers; never embeddings, norms,
                       routers, lm_head): a family table of its own
    compare.py         verify's side: each scheme's Encoding (which stored weights, decoded with which tensors, the
                       bound per element, how transformers loads the model), which verifier/bounded.py runs

Outside this part the engine and the verifier name no scheme: table.py registers a rewrite of any family's result
(families.base.register_rewrite, turned on by OutputSettings.quantize), whose quantization_config finalize makes on
rank 0 (Plan.config_later: a schemes.Quantized record); verifier/listing.py asks compare.encoding_of.
"""
