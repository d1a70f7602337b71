"""Peer for bench_dcp.py: PyTorch's documented DCP -> single-file route, then safetensors. One process.

    python tests/bench/peer_torch_save.py --input DCP_DIR --output OUT [--max-shard-size BYTES] [--json-summary P]

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` loads the whole checkpoint into memory and
torch.saves it to OUT/consolidated.pt; that file is loaded back (plain ``torch.load``, as a user following the
docs would) and written as safetensors + index by the same splitter/writer as baseline_merge.py, so the
layout matches distmerge's. The intermediate .pt is deleted at the end: it is part of this route's cost, not
of its result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from baseline_merge import finish, save


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes (default 5GB, like HF)")
    parser.add_argument("--json-summary", type=Path, help="write {'seconds': merge time after imports}")
    args = parser.parse_args()
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    start = time.perf_counter()  # own time after imports, measured like distmerge's and the baseline's
    args.output.mkdir(parents=True, exist_ok=True)
    tmp = args.output / "consolidated.pt"
    dcp_to_torch_save(args.input, tmp)
    state = torch.load(tmp, map_location="cpu", weights_only=True)
    # Megatron torch_dist saves also hold each layer's `_extra_state` (lists of torch-saved bytes): not weights
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    save(state, args.output, args.max_shard_size)
    del state
    tmp.unlink()
    finish(args, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
