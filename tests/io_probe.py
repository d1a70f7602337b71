"""Run one distmerge command and record, from the kernel's side, how many bytes this process read.

    torchrun --nproc-per-node N tests/io_probe.py RECORD_DIR merge --input IN --output OUT ...

Each rank writes RECORD_DIR/rank{R}.json with the growth of `rchar` (/proc/self/io) across
`distmerge.front.cli.main`: every byte the process got from read, pread, readv, sendfile and copy_file_range,
page-cache hits included, counted by the kernel, not by distmerge. Every distmerge module, and what the input's
format imports lazily, is imported before the count starts, so Python reading its own modules stays out. Two
modules are left out: they import transformers (seconds per rank) and no merge imports them (were one to, the
bytes of its modules would count as reads, and the promise tests would fail, not pass wrongly). What transformers
brought in that a merge under torchrun imports later (torch.distributed.nn, on starting the process group) is
imported by name.
Used by tests/test_promises.py.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

import distmerge
import distmerge.front.cli


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def import_everything(argv: list[str]) -> None:
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (the import's .metadata: dcp/write.py, lazily)
    import torch.distributed.nn  # noqa: F401  (imported when the process group starts)

    for module in pkgutil.walk_packages(distmerge.__path__, "distmerge."):
        # transformers: never on the merge path (the HF Trainer callback is imported by training scripts only)
        if not module.name.startswith(("distmerge.verifier.logits", "distmerge.hooks.hf_trainer")):
            importlib.import_module(module.name)


def main() -> int:
    record, argv = Path(sys.argv[1]), sys.argv[2:]
    import_everything(argv)
    before = rchar()
    rc = distmerge.front.cli.main(argv)
    read = rchar() - before
    rank = int(os.environ.get("RANK", "0"))
    (record / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rchar": read, "rc": rc}))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
