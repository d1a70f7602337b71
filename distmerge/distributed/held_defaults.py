"""Default arguments that hold a borrowed group after distmerge is done with it, given back.

Some torch.distributed modules take the default group as a default argument, evaluated once, at their import:
torch.distributed.nn.functional's collectives (`group=group.WORLD`), FSDP's ShardedGradScaler, ZeroRedundancyOptimizer.
Imported while a job's group is up, they hold that group until interpreter exit, past the job's own
destroy_process_group(); the group's gloo worker threads then end during finalization and the C++ runtime aborts
the process ("terminate called without an active exception", SIGABRT) in about one exit of 15.

A command imports them before it starts its group (comm._start_group). The API borrows a group that is already
up, and a call can import them for the first time: writing a DCP `.metadata` imports torch.distributed.checkpoint,
whose package imports torch.distributed.nn.functional. So a borrowing Comm notes the torch.distributed modules
loaded when it starts (`loaded_now`), and on close hands back what the call's imports took (`give_back`): each
default that is the borrowed group becomes None, which these functions read as the default group, looked up per
call, exactly what importing them before the group would have given. Modules the job loaded itself are left as
they are (their defaults are the job's doing, and may be meant).
"""

from __future__ import annotations

import sys
import types
from typing import Any

PACKAGE = "torch.distributed"


def loaded_now() -> frozenset[str]:
    """The names of the torch.distributed modules imported so far."""
    return frozenset(name for name in list(sys.modules) if _in_package(name))


def give_back(group: Any, loaded_before: frozenset[str]) -> int:
    """Every default argument that is `group`, in the functions of the torch.distributed modules imported since
    `loaded_before` (module functions, and the methods of classes they define), set to None; how many."""
    given = 0
    for name, module in list(sys.modules.items()):
        if name in loaded_before or not _in_package(name) or not isinstance(module, types.ModuleType):
            continue
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name:  # defined here, not imported from elsewhere
                continue
            members = vars(value).values() if isinstance(value, type) else (value,)
            given += sum(_released(_function(member), group) for member in members)
    return given


def _in_package(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _function(member: Any) -> types.FunctionType | None:
    member = getattr(member, "__func__", member)  # staticmethod, classmethod
    return member if isinstance(member, types.FunctionType) else None


def _released(function: types.FunctionType | None, group: Any) -> int:
    if function is None:
        return 0
    given = 0
    if function.__defaults__ and any(d is group for d in function.__defaults__):
        given += sum(d is group for d in function.__defaults__)
        function.__defaults__ = tuple(None if d is group else d for d in function.__defaults__)
    if function.__kwdefaults__ and any(d is group for d in function.__kwdefaults__.values()):
        given += sum(d is group for d in function.__kwdefaults__.values())
        function.__kwdefaults__ = {k: None if d is group else d for k, d in function.__kwdefaults__.items()}
    return given
