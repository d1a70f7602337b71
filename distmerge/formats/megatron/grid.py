"""Which model-parallel rank wrote each `mp_rank_*` folder of a legacy Megatron save, and whether the
grid of TP x PP x EP ranks is complete.

    mp_rank_{tp:02d}                    TP only
    mp_rank_{tp:02d}_{pp:03d}           PP > 1            \\ same spelling: `args` (pipeline/expert
    mp_rank_{tp:02d}_{ep:03d}           EP > 1, PP == 1   /  parallel sizes) says which one it is
    mp_rank_{tp:02d}_{pp:03d}_{ep:03d}  PP > 1 and EP > 1
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice, product
from pathlib import Path
from typing import Any

from distmerge.errors import InputError, LayoutError
from distmerge.formats.base import inside
from distmerge.formats.megatron import layout as mg
from distmerge.formats.torch_private import torch_save
from distmerge.formats.torch_private.restricted import TensorRef
from distmerge.input.source import Source


@dataclass(frozen=True, kw_only=True)
class Grid:
    tp: int
    pp: int
    ep: int
    etp: int  # expert tensor parallel size: experts are split over this many of the TP ranks
    coords: dict[str, tuple[int, int, int]]  # file path (relative) -> (tp, pp, ep)

    @property
    def paths(self) -> list[str]:
        return sorted(self.coords, key=lambda p: (self.coords[p][1], self.coords[p][2], self.coords[p][0]))

    def path_of(self, tp: int, pp: int, ep: int) -> str:
        return next(p for p, c in self.coords.items() if c == (tp, pp, ep))

    @property
    def sizes(self) -> dict[str, int]:
        """The parallel sizes under Megatron-LM's args names, to check each file's args against."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "expert_model_parallel_size": self.ep}

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + [f"EP={self.ep}"] * (self.ep > 1)
        return " x ".join(parts) + (f" (expert TP={self.etp})" if self.ep > 1 and self.etp != self.tp else "")


def resolve_grid(src: Source, save: Path) -> Grid:
    folders = _rank_folders(src, save)
    first = save / folders[min(folders)]
    args = _args(torch_save.read(src, first).value)
    spellings = {len(numbers) for numbers in folders}
    if len(spellings) > 1:
        shown = ", ".join(sorted(Path(p).parent.name for p in folders.values())[:6])
        raise InputError(f"{save} mixes mp_rank folder spellings ({shown}): files of several saves are "
                         "duplicated here; keep one set")
    coords = {path: _coords(src, numbers, args, save, folders) for numbers, path in folders.items()}
    tp, pp, ep = (max(c[i] for c in coords.values()) + 1 for i in range(3))
    _check_sizes(save, args, tp, pp, ep)
    _check_complete(save, coords, tp, pp, ep)
    etp = _arg(args, "expert_tensor_parallel_size") or tp
    if ep > 1 and etp not in (1, tp):
        raise LayoutError(f"{save}: expert tensor parallel size {etp} with TP={tp} is not supported (only 1 or TP)")
    return Grid(tp=tp, pp=pp, ep=ep, etp=etp, coords=coords)


def _rank_folders(src: Source, save: Path) -> dict[tuple[int, ...], str]:
    found: dict[tuple[int, ...], str] = {}
    for folder in [save / n for n in src.listdir(save) if src.is_dir(save / n) and mg.RANK_DIR.match(n)]:
        numbers = tuple(int(n) for n in mg.RANK_DIR.match(folder.name).groups() if n is not None)
        models = [f for f in mg.MODEL_FILES if src.is_file(folder / f)]
        if not models:
            raise InputError(f"{folder} has no {' or '.join(mg.MODEL_FILES)}: the save is incomplete")
        if len(models) > 1:
            raise InputError(f"{folder} holds both {' and '.join(models)}: keep the one of this save")
        found[numbers] = f"{folder.name}/{models[0]}"
        inside(src, save, found[numbers])  # a rank file that links out is refused before its pickle is read
    if not found:
        raise InputError(f"{save} has no mp_rank_* folders")
    return found


def _args(value: Any) -> Any:
    return value.get("args") if isinstance(value, dict) else None


def _arg(args: Any, name: str) -> int | None:
    value = getattr(args, name, None)
    return value if isinstance(value, int) else None


def _coords(src: Source, numbers: tuple[int, ...], args: Any, save: Path, folders: dict) -> tuple[int, int, int]:
    if len(numbers) == 1:
        return (numbers[0], 0, 0)
    if len(numbers) == 3:
        return numbers
    return (numbers[0], numbers[1], 0) if _second_is_pp(src, args, save, folders) else (numbers[0], 0, numbers[1])


def _second_is_pp(src: Source, args: Any, save: Path, folders: dict) -> bool:
    """mp_rank_TT_NNN: a pipeline stage or an expert-parallel rank? `args` says; without it, a second
    stage has no word embeddings while every expert-parallel rank of stage 0 has them."""
    pp, ep = _arg(args, "pipeline_model_parallel_size"), _arg(args, "expert_model_parallel_size")
    if pp is not None or ep is not None:
        if (pp or 1) > 1 and (ep or 1) > 1:
            raise InputError(f"{save}: args say PP={pp} and EP={ep} but the folders carry only two numbers")
        return (pp or 1) > 1
    other = next((p for n, p in folders.items() if n[1] == 1), None)
    if other is None:
        raise InputError(f"{save}: cannot tell whether mp_rank_TT_NNN numbers pipeline stages or expert ranks "
                         "(no args in the files and no folder numbered 1)")
    chunks = model_chunks(torch_save.read(src, save / other).value, save / other)
    return not any("embedding.word_embeddings.weight" in state for state in chunks)


def model_chunks(value: Any, path: Path) -> list[dict[str, Any]]:
    """The model state dicts of a file: `model`, or `model0`, `model1`, ... with virtual pipeline stages,
    or (older verl model.pt) the file's dict itself."""
    if not isinstance(value, dict):
        raise InputError(f"{path} does not hold a dict: not a Megatron checkpoint file")
    if isinstance(value.get("model"), dict):
        return [value["model"]]
    numbered = sorted((int(k[5:]), v) for k, v in value.items() if k[:5] == "model" and k[5:].isdigit())
    if numbered:
        return [v for _, v in numbered]
    if any(isinstance(v, TensorRef) for v in value.values()):
        return [value]
    raise InputError(f"{path} has no model weights (keys: {', '.join(sorted(map(str, value))[:6])}): "
                     "an optimizer-only or non-model file")


def _check_sizes(save: Path, args: Any, tp: int, pp: int, ep: int) -> None:
    for what, found in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("expert_model_parallel_size", ep)):
        saved = _arg(args, what)
        if saved is not None and saved != found:
            raise InputError(f"{save}: the files' args say {what}={saved} but the mp_rank folders make {found}: "
                             "rank folders are missing or extra")


def _check_complete(save: Path, coords: dict, tp: int, pp: int, ep: int) -> None:
    """The grid the folder names span must be all there. Its size comes from names, so it is compared with
    the folders present before anything is enumerated: the first missing ones are found within
    len(have) + 6 steps, however large a crafted name makes the grid."""
    have = set(coords.values())
    if tp * pp * ep > len(have):
        missing = list(islice((c for c in product(range(tp), range(pp), range(ep)) if c not in have), 6))
        shown = ", ".join(f"TP {t} PP {p}" + (f" EP {e}" if ep > 1 else "") for t, p, e in missing[:6])
        raise InputError(f"{save}: rank folders missing for {shown} (TP={tp} x PP={pp} x EP={ep}): "
                         "copy them back or merge a complete save")
