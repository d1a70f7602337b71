"""`distmerge inspect`: what a checkpoint holds and what a merge would write, without writing."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

from rich.console import Console
from rich.table import Table

from distmerge import discover as disc
from distmerge import families
from distmerge import plan as planning
from distmerge.dtypes import CAST_CHOICES
from distmerge.families.hf import ties_embeddings
from distmerge.formats import registry
from distmerge.mapping import FamilyContext
from distmerge.reader import Reader
from distmerge.report import human_bytes


def describe(args: argparse.Namespace) -> dict:
    root = disc.check_input(args.input)
    found = disc.discover(root, args.format, args.hf_config, args.iteration)
    scan = found.scan
    reader = Reader(scan, registry.FORMATS[scan.format])
    try:
        fragments = reader.open(list(range(len(scan.files))))
        layout: Counter[str] = Counter()
        for opened in reader.opened.values():
            layout.update(opened.layout)
    finally:
        reader.close()
    sources = planning.merge_inventories(fragments, scan.files)
    metas = {n: s.meta for n, s in sources.items()}
    ctx = FamilyContext(config=found.config, cast=CAST_CHOICES[args.dtype], details=scan.details)
    result = families.units_for(scan.details.get("naming", "hf"), metas, ctx)
    plan = planning.make_plan(sources=sources, units=result.units, files=scan.files, world=1,
                              max_shard_bytes=args.max_shard_size, budget_bytes=2**62, notes=tuple(result.notes))
    targets = [t for f in plan.files for t in f.targets]
    return {
        "input": str(root),
        "format": scan.format,
        "world_size": scan.world_size,
        "input_files": len(scan.files),
        "input_bytes": sum(f.size for f in scan.files),
        "sharding": dict(layout.most_common()),
        "tensors": len(targets),
        "parameters": sum(math.prod(t.shape) for t in targets),
        "bytes": plan.total_bytes,
        "dtypes": dict(Counter(t.dtype for t in targets).most_common()),
        "tied_embeddings": ties_embeddings(found.config),
        "architectures": found.config.get("architectures", []),
        "output_files": [{"name": f.name, "tensors": len(f.targets), "bytes": f.nbytes} for f in plan.files],
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
        ("model", f"{', '.join(info['architectures']) or '?'}, tied embeddings: {info['tied_embeddings']}"),
        ("tensors", f"{info['tensors']} ({info['parameters']:,} parameters, {human_bytes(info['bytes'])})"),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items())),
    ]
    for f in info["output_files"]:
        rows.append(("output", f"{f['name']}: {f['tensors']} tensors, {human_bytes(f['bytes'])}"))
    rows += [("note", n) for n in info["notes"]]
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(100, Console().width))
    console.print(f"distmerge inspect {info['input']}", markup=False)
    console.print(table)
    return 0
