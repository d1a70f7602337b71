"""`distmerge inspect`: what a checkpoint holds and what a merge would write, without writing."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from distmerge.engine import discover as disc
from distmerge.engine.prepare import plan_merge
from distmerge.engine.reader import Reader
from distmerge.families.base import claim
from distmerge.formats import registry
from distmerge.input.source import name_of
from distmerge.options.cli_options import base_model_dir, format_options, output_settings
from distmerge.report import human_bytes


def describe(args: argparse.Namespace) -> dict:
    """What `merge` with the same options would do, planned as merge plans it (one process)."""
    values = vars(args)
    root = disc.check_input(args.input)
    found = disc.discover(root, args.format, args.hf_config, format_options(values), base_model_dir(values))
    scan = found.scan
    reader = Reader(scan, registry.get(scan.format))
    try:
        fragments = reader.open(list(range(len(scan.files))))
        layout: Counter[str] = Counter()
        for opened in reader.opened.values():
            layout.update(opened.layout)
    finally:
        reader.close()
    plan = plan_merge(found, fragments, 1, output_settings(values))
    traits = claim([f.name for f in fragments], found.config, scan.hints).traits(found.config)
    targets = [t for f in plan.files for t in f.targets]
    return {
        "input": str(root) if isinstance(args.input, Path) else name_of(args.input),  # a Source: its url
        "format": scan.format,
        "world_size": scan.world_size,
        "input_files": len(scan.files),
        "input_bytes": sum(f.size for f in scan.files),
        "sharding": dict(layout.most_common()),
        "tensors": len(targets),
        "parameters": sum(math.prod(t.shape) for t in targets),
        "bytes": plan.total_bytes,
        "dtypes": dict(Counter(t.dtype for t in targets).most_common()),
        "tied_embeddings": traits.ties(found.config),
        "architectures": found.config.get("architectures") or [],
        "model_type": found.config.get("model_type"),
        "output_files": [{"name": f.name, "tensors": len(f.targets), "bytes": f.nbytes} for f in plan.files],
        "extra_files": sorted(plan.extra_files),
        "notes": [*scan.notes, *plan.notes],
    }


def run_inspect(args: argparse.Namespace) -> int:
    info = describe(args)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("format", f"{info['format']}, world size {info['world_size']}, {info['input_files']} rank files, "
                   f"{human_bytes(info['input_bytes'])}"),
        ("sharding", "; ".join(f"{k} x{v}" for k, v in info["sharding"].items())),
        ("model", f"{', '.join(info['architectures']) or info['model_type'] or '?'}, "
                  f"tied embeddings: {info['tied_embeddings']}"),
        ("tensors", f"{info['tensors']} ({info['parameters']:,} parameters, {human_bytes(info['bytes'])})"),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items())),
    ]
    for f in info["output_files"]:
        rows.append(("output", f"{f['name']}: {f['tensors']} tensors, {human_bytes(f['bytes'])}"))
    rows += [("output", name) for name in info["extra_files"]]
    rows += [("note", n) for n in info["notes"]]
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(100, Console().width))
    console.print(f"distmerge inspect {info['input']}", markup=False)
    console.print(table)
    return 0
