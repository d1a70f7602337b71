"""Union-find: items joined into groups, the groups read back in the order their first item was seen."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class DisjointSets(Generic[T]):
    """Groups of items, joined two at a time; an item not joined to any other is a group of its own."""

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._parent: dict[T, T] = {}
        for item in items:
            self.root(item)

    def root(self, item: T) -> T:
        """Return the item that stands for `item`'s group (adding `item` as a group of its own when new)."""
        parent = self._parent
        parent.setdefault(item, item)
        while parent[item] != item:
            parent[item] = parent[parent[item]]  # halve the path: later look-ups are shorter
            item = parent[item]
        return item

    def join(self, a: T, b: T) -> None:
        """Make `a`'s group and `b`'s one."""
        ra, rb = self.root(a), self.root(b)
        if ra != rb:
            self._parent[ra] = rb

    def groups(self) -> list[list[T]]:
        """Return every group, each in the order its items were first seen, the groups in the order of their
        first item."""
        found: dict[T, list[T]] = {}
        for item in list(self._parent):
            found.setdefault(self.root(item), []).append(item)
        return list(found.values())
