"""Run one distmerge command and record, from the kernel's side, how many bytes this process read.

    torchrun --nproc-per-node N tests/io_probe.py RECORD_DIR merge --input IN --output OUT ...

Each rank writes RECORD_DIR/rank{R}.json with the growth of `rchar` (/proc/self/io) across
`distmerge.front.cli.main`: every byte the process got from read, pread, readv, sendfile and copy_file_range,
page-cache hits included, counted by the kernel, not by distmerge. Every distmerge module, and what the input's
format imports lazily, is imported before the count starts, so Python reading its own modules stays out.
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
    for module in pkgutil.walk_packages(distmerge.__path__, "distmerge."):
        if not module.name.startswith("distmerge.verifier.logits"):  # transformers: never on the merge path
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
