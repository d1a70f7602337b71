"""llm-compressor's model_free_ptq, the peer of `--quantize nvfp4 | mxfp4`, run by the peer's own environment
(.venv-peer, launch/setup_peer.sh: llm-compressor 0.14 pins transformers and compressed-tensors versions of its own):
each job quantizes a merged Hugging Face folder's safetensors without loading a model.

    .venv-peer/bin/python tests/bench/peer_model_free_ptq.py --input MERGED --output OUT --scheme NVFP4A16 \
        [--ignore JSON] [--max-workers 2] [--json-summary FILE]
    .venv-peer/bin/python tests/bench/peer_model_free_ptq.py --jobs JOBS.json     (tests: several in one process)

JOBS.json: a list of {"input", "output", "scheme", "ignore"}. --ignore defaults to the issue's list, ["lm_head",
"re:.*embed_tokens$"]. The whole process is what bench_quantize.py times (the imports included, as a user's run).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time
from pathlib import Path

IGNORE = ["lm_head", "re:.*embed_tokens$"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--scheme", default="NVFP4A16")
    parser.add_argument("--ignore", type=json.loads, default=IGNORE)
    parser.add_argument("--max-workers", type=int, default=1)
    parser.add_argument("--jobs", type=Path)
    parser.add_argument("--json-summary", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    logging.disable(logging.WARNING)
    from loguru import logger

    logger.remove()  # its progress lines, one per shard and file
    from llmcompressor import model_free_ptq

    jobs = json.loads(args.jobs.read_text()) if args.jobs else [
        {"input": str(args.input), "output": str(args.output), "scheme": args.scheme, "ignore": args.ignore}]
    for job in jobs:
        model_free_ptq(job["input"], job["output"], scheme=job["scheme"], ignore=job.get("ignore", IGNORE),
                       max_workers=args.max_workers, device="cpu")
    if args.json_summary:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        args.json_summary.write_text(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak}))


if __name__ == "__main__":
    main()
