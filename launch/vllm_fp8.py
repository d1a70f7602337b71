"""Load a quantized folder (FP8 or 4-bit) written by `distmerge merge --quantize` with vLLM and generate a few tokens
(launch/gpu_check.sh runs it when vLLM is installed on the GPU machine). Prints one line: the quantization vLLM
loaded the folder with and the greedy tokens; exit 0 when vLLM loaded it as the expected method and generated,
1 otherwise.

    python launch/vllm_fp8.py FOLDER fp8|compressed-tensors

The folders gpu_check merges have no tokenizer: the prompt is token ids, and vLLM starts without a tokenizer.
"""

from __future__ import annotations

import sys


def main(folder: str, method: str) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              gpu_memory_utilization=0.3, seed=0)
    loaded = llm.llm_engine.model_config.quantization
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(range(1, 17))}], params, use_tqdm=False)
    tokens = list(out[0].outputs[0].token_ids)
    print(f"vllm loaded {folder} with quantization={loaded}; greedy tokens {tokens}")
    return 0 if loaded == method and len(tokens) == 8 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
