"""torch's intra-op threads, set aside where they only cost."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block, the caller's count restored after it. For work made of many small
    operations (decoding a DCP `.metadata` in batches of 32k records, comparing 16 Ki-element verify blocks): a
    second thread only waits for the first, and beside other busy processes it waits long (decoding 5x slower;
    verify of the bench model, N=1 on 2 busy cores, 40 s instead of 2.3 s). Processes are the parallelism."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
