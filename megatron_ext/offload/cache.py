"""Host cache of subgroup states, in least-recently-used order.

With the alternating order (ascending on one step, descending on the next) the
subgroups a pass touched last are the ones the next pass needs first, so evicting the
least recently used keeps exactly the useful tail of the previous pass; with a fixed
order the same policy evicts what the next pass needs first, which is the point of
alternating. Pure bookkeeping: buffers are allocated by the caller's ``alloc``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterable, List, Optional

import torch


@dataclasses.dataclass
class Entry:
    """A resident subgroup: its state buffer and whether the tier's copy is stale."""

    buffer: torch.Tensor
    dirty: bool


class HostCache:
    """At most ``capacity`` subgroup buffers (None: unlimited)."""

    def __init__(self, capacity: Optional[int], alloc: Callable[[], torch.Tensor]):
        self.capacity = capacity
        self._alloc = alloc
        self._entries: "collections.OrderedDict[int, Entry]" = collections.OrderedDict()
        self._free: List[torch.Tensor] = []
        self.allocated = 0

    def __contains__(self, subgroup: int) -> bool:
        return subgroup in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, subgroup: int) -> Entry:
        """The resident entry, marked most recently used."""
        self._entries.move_to_end(subgroup)
        return self._entries[subgroup]

    def insert(self, subgroup: int, buffer: torch.Tensor, dirty: bool) -> Entry:
        """Makes ``subgroup`` resident in ``buffer`` (most recently used)."""
        entry = Entry(buffer, dirty)
        self._entries[subgroup] = entry
        return entry

    def pop(self, subgroup: int) -> Entry:
        """Removes a resident subgroup; its buffer is the caller's again."""
        return self._entries.pop(subgroup)

    def items(self):
        """(subgroup, entry) pairs, least recently used first."""
        return list(self._entries.items())

    def can_allocate(self) -> bool:
        """Whether a new buffer fits in the budget (or a freed one is waiting)."""
        return bool(self._free) or self.capacity is None or self.allocated < self.capacity

    def allocate(self) -> torch.Tensor:
        """A freed buffer, or a new one counted against the capacity."""
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return self._alloc()

    def release(self, buffer: torch.Tensor) -> None:
        """Returns a buffer no subgroup uses any more."""
        self._free.append(buffer)

    def discard(self, buffer: torch.Tensor) -> None:
        """Forgets a buffer no subgroup uses any more, so that its memory can be freed.

        The caller drops its last reference; it no longer counts against the capacity.
        """
        del buffer
        self.allocated -= 1

    def victim(self, exclude: Iterable[int]) -> Optional[int]:
        """The least recently used resident subgroup not in ``exclude``."""
        skip = set(exclude)
        for subgroup in self._entries:
            if subgroup not in skip:
                return subgroup
        return None
