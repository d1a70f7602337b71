"""The name a torch.save file was saved under, read from its first zip record.

torch.save writes every record of its zip under one folder named after the file's stem
(`model_world_size_4_rank_1/data.pkl`, `zero_pp_rank_3_mp_rank_00_optim_states/data/0`); a copy or a rename
keeps it. So a rank file renamed to another rank's name says which file it was. Only the first local
header is read (30 bytes and the name), whatever the file holds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

from distmerge.errors import LayoutError
from distmerge.input.source import Source

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header: signature ... name length, extra length
LOCAL_SIGNATURE = 0x04034B50
NAME_READ = 256  # record names torch.save writes are far shorter (`<stem>/data.pkl`)


def saved_stem(src: Source, path: Path) -> str | None:
    """The folder torch.save put the records under, or None (not a zip, or saved to a file object)."""
    with src.open(path) as f:
        head = f.pread(LOCAL_HEADER.size + NAME_READ, 0)  # the name with the header: one read (a GET on a store)
        if len(head) < LOCAL_HEADER.size:
            return None
        fields = LOCAL_HEADER.unpack_from(head)
        if fields[0] != LOCAL_SIGNATURE:
            return None
        end = LOCAL_HEADER.size + fields[9]
        raw = head[LOCAL_HEADER.size : end] if end <= len(head) else f.pread(fields[9], LOCAL_HEADER.size)
        name = raw.decode("utf-8", errors="replace")
    return name.split("/", 1)[0] if "/" in name else None


def check_saved_name(src: Source, path: Path, names: Iterable[str]) -> None:
    """Refuse a rank file whose records were saved under the name of another file of its set (`names`). A
    name that matches no file of the set (a save written under a temporary name, then renamed) is accepted."""
    stems = {Path(n).stem: Path(n).name for n in names}
    saved = saved_stem(src, path)
    if saved is not None and saved != path.stem and saved in stems:
        raise LayoutError(f"{path.name} was saved as {stems[saved]} (the name inside its archive): a rank file "
                          "renamed to another rank's name; restore the original files")


def check_saved_names(src: Source, paths: list[Path]) -> None:
    for path in paths:
        check_saved_name(src, path, [p.name for p in paths])
