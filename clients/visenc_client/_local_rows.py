"""The rows ``VisencConnector``'s scheduler side holds until vLLM's workers load them."""

from __future__ import annotations

from collections import OrderedDict

import torch


class LocalRows:
    """LRU within a byte budget, scheduler thread only; ``pinned`` entries (present this step) are never evicted."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.pinned: set[str] = set()

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._rows

    def get(self, identifier: str) -> torch.Tensor | None:
        rows = self._rows.get(identifier)
        if rows is not None:
            self._rows.move_to_end(identifier)
        return rows

    def put(self, identifier: str, rows: torch.Tensor) -> bool:
        size = rows.numel() * rows.element_size()
        for victim in [k for k in self._rows if k not in self.pinned]:
            if self.bytes + size <= self.budget_bytes:
                break
            self.bytes -= self._rows[victim].numel() * self._rows[victim].element_size()
            del self._rows[victim]
        if self.bytes + size > self.budget_bytes:
            return False
        self._rows[identifier] = rows
        self.bytes += size
        return True
