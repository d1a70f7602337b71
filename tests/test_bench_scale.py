"""bench_scale.py's simulated inventories against real saves (issue #14, item 3): the frontier-scale figures in
docs/benchmarks.md rest on the simulation giving the plan the real files give, so it is checked here on a real
dcp.save folder of an FSDP2 model (uneven Shard(0) rows: 138 = 35 + 35 + 35 + 33 over W=4, bf16).

bench_scale_real.py runs in its own process: importing bench_scale registers the bench's DeepSeek-V3 name
family, which must not reach the other tests' family registry.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench"


def test_simulated_dcp_inventory_plans_like_the_real_save(dcp_ckpts):
    """Same readers, output files, owners, rounds and blocks, and the same packed inventory size, for N = 1, 2, 3.

    Shown to fail: with dcp_inventories placing chunks without their elements (`at += BLOB_HEAD + BLOB_TAIL`),
    the byte offsets pack narrower (2 KB against 3 KB at N = 1); with Shard(0)'s rows split by floor division
    in fsdp_inventories, the simulated inventory does not cover lm_head.weight and the bench exits with the
    planner's LayoutError.
    """
    ckpt = dcp_ckpts["dcp_llama_bf16_w4"]
    run = subprocess.run([sys.executable, str(BENCH / "bench_scale_real.py"), "--input", str(ckpt),
                          "--procs", "1", "2", "3"], cwd=BENCH, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(dcp): W=4, 84 fragments" in run.stdout, run.stdout
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if re.match(r"\| \d+ \|", line)]
    assert [r[0] for r in rows] == ["1", "2", "3"], run.stdout
    for n, _, _, real_kb, simulated_kb, readers, outputs in rows:
        assert (real_kb, readers, outputs) == (simulated_kb, "True", "True"), f"N={n}:\n{run.stdout}"
