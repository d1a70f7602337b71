"""The store namespaces of this process's groups: one counter for the whole process, the only one.

Every group distmerge starts on torchrun's store (comm.py's own group, the watchdog beside it) needs keys of its own:
torch keys each default group alike, so a second merge in one process would read the first's keys (its gloo
addresses, its watchdog's records). Every rank starts the same groups in the same order, so the same count on every
rank names the same namespace, and no two groups of one process share one (tests/test_api.py runs five merges in one
process). One counter, not one per kind: two counters that must stay in step are one more thing to keep in step.
"""

from __future__ import annotations

import itertools

_STARTED = itertools.count()  # what this process has started that keeps keys on the store, in order


def next_namespace(kind: str) -> str:
    """Return `distmerge/KIND/N`, N the next number of this process: a namespace no earlier call gave, and the same
    on every rank when every rank makes the same calls in the same order."""
    return f"distmerge/{kind}/{next(_STARTED)}"
