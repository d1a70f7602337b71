"""Peer for bench_dcp.py: accelerate's merge (what `accelerate merge-weights DIR OUT` runs), timed after
imports like the other tools. One process; writes OUT/model.safetensors (no index, no config).

    python tests/bench/peer_accelerate.py --input DCP_DIR --output OUT [--json-summary P]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--json-summary", type=Path, help="write {'seconds': merge time after imports}")
    args = parser.parse_args()
    from accelerate.utils import merge_fsdp_weights

    start = time.perf_counter()
    merge_fsdp_weights(str(args.input), str(args.output), safe_serialization=True)
    if args.json_summary:
        args.json_summary.write_text(json.dumps({"seconds": time.perf_counter() - start}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
