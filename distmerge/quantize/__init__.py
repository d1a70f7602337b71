"""The quantize part: which weights an output quantizes and how their bytes and config are made, one object per
scheme.

    scheme.py            what every scheme answers (its name and description, the tensors a weight becomes and
                         their bytes, config.json's quantization_config and dtype, and verify's side: which
                         stored tensors it finds, each weight's decoder with its bound, how transformers loads it)
    schemes.py           the registry, one line per scheme: the command line's choices and help come from it
    fp8.py               fp8-block and fp8-channel: FP8 (e4m3) weights, per 128x128 block or per channel
    fp4.py               nvfp4 and mxfp4: e2m1 weights packed two a byte, in compressed-tensors' formats
    compressed_config.py compressed-tensors' quantization_config, made by its own classes (the `quantize` extra)
    table.py             which weights a family quantizes (attention and MLP linear layers; never embeddings,
                         norms, routers, lm_head), and the units that write them
    fused.py             the weights vLLM fuses, which share a scale (nvfp4's global scale)
    compare.py           verify's bridge: the scheme of a folder or of a plan (encoding_of)

Outside this part the engine and the verifier name no scheme: catalog.py registers table.py's rewrite of any
family's result (turned on by OutputSettings.quantize), whose quantization_config and dtype finalize makes on rank 0
(Plan.config_later: a schemes.Quantized record); verifier/listing.py asks compare.encoding_of; output_options.py
reads the registry's choices.
"""
