"""``TableCache``: derived tables (per-grid position embeddings, rotary factors) kept in a
least-recently-used map bounded in bytes and in entries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


class TableCache:
    """A least-recently-used map from a key to a derived tensor, bounded in bytes and in
    entries (one per image grid: with images of many shapes the entry bound is what keeps
    the many small tables of small images from adding up to ``max_bytes``).

    A table larger than the byte bound is returned but not kept. Callers never
    modify a returned table in place.
    """

    def __init__(self, max_bytes: int, max_entries: int = 64):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(
                f"a table cache needs max_bytes >= 0 and max_entries >= 0, got {max_bytes} "
                f"and {max_entries}."
            )
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.bytes = 0
        self._tables: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, key: Hashable, compute: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """The table under ``key``, or ``compute(*args)`` (kept if it fits)."""
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
        table = compute(*args)
        size = table.numel() * table.element_size()
        with self._lock:
            if size <= self.max_bytes and self.max_entries and key not in self._tables:
                self._tables[key] = table
                self.bytes += size
                while self.bytes > self.max_bytes or len(self._tables) > self.max_entries:
                    _, old = self._tables.popitem(last=False)
                    self.bytes -= old.numel() * old.element_size()
        return table

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self.bytes = 0

    def __getstate__(self) -> dict:  # a copy or a pickle starts empty
        return {"max_bytes": self.max_bytes, "max_entries": self.max_entries}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_bytes"], state.get("max_entries", 64))
