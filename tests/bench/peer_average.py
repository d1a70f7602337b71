"""Peer for bench_average.py: the plain way to average K checkpoints. One process (and one merge each).

    python tests/bench/peer_average.py --input C1 --input C2 ... --output OUT --work TMP [--json-summary P]

Merge each checkpoint alone (`python -m distmerge merge`, one process: the fastest merge there is, so the plain way
is not slowed by its merger), load the K merged models with `from_pretrained`, average their parameters in torch
with docs/average.md's formula (float64 sum in input order, weights 1/K, cast once: so both ways write the same
tensors), and `save_pretrained` the first model holding the average. The K merged folders are deleted at the end:
they are this route's cost, not its result. Its own timer and peak RSS cover the merges too (the largest of them
and of this process, RUSAGE_CHILDREN).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, action="append", required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the K merged models go (deleted after)")
    parser.add_argument("--json-summary", type=Path, help="write {'seconds', 'ranks': [{'peak_rss'}]}")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    merged = [args.work / f"merged_{i}" for i in range(len(args.input))]
    for ckpt, dest in zip(args.input, merged, strict=True):
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "distmerge", "merge", "--input", str(ckpt), "--output", str(dest),
                        "--quiet"], check=True)
    models = [AutoModelForCausalLM.from_pretrained(d, dtype="auto") for d in merged]
    weight = 1 / len(models)
    params = [dict(m.named_parameters()) for m in models]
    with torch.no_grad():
        for name, param in params[0].items():
            acc = torch.zeros(param.shape, dtype=torch.float64)
            for one in params:
                acc += weight * one[name].double()
            param.copy_(acc.to(param.dtype))
    models[0].save_pretrained(args.output)
    seconds = time.perf_counter() - start
    for dest in merged:
        shutil.rmtree(dest)
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    if args.json_summary:
        args.json_summary.write_text(json.dumps({"seconds": seconds, "ranks": [{"rank": 0, "peak_rss": peak * 1024}]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
