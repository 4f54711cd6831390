"""The resident batch's KV cache for :mod:`orchestrator.engines.torch_engine`.

:class:`SlotCache` is a ``transformers`` ``DynamicCache`` whose layers' ``keys`` and
``values`` are views of preallocated buffers ``[slots, heads, capacity, head_dim]``, written
in place: a decode step writes one column instead of copying the whole cache, as
``DynamicCache`` does. Rows (sequences) join from a prefill and leave when they stop; every
row's cached tokens are right-aligned (left padding), so one window of columns serves all.

Limits: plain full-attention key/value layers only (what ``DynamicCache()`` without a model
config builds); sliding-window layers are cached in full.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, DynamicLayer


class SlotCache(DynamicCache):
    """A batch KV cache updated in place, for rows that come and go.

    Per layer, keys and values live in buffers ``[slots, heads, capacity, head_dim]``:
    rows ``[0, rows)`` are the resident sequences and columns ``[start, end)`` the window
    every layer's ``keys``/``values`` show (views). A row's cached tokens end at column
    ``end - 1`` (left padding). A decode step writes its column at ``end`` in place
    (``DynamicCache`` concatenates, copying the whole cache every token); a row that
    leaves is overwritten by one of the last rows; trimming moves ``start``; a joining
    prefill is copied into new rows. Buffers are reallocated, with room to spare, only
    when rows run out (or columns, and sliding the window back
    does not make room); a drained batch's buffers serve the next one.
    """

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.rows = self.start = self.end = 0
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def width(self) -> int:
        return self.end - self.start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's write: the new columns at ``end`` (callers reserve and commit)."""
        keys, values = self.buffers[layer_idx]
        n = key_states.shape[-2]
        keys[: self.rows, :, self.end : self.end + n] = key_states
        values[: self.rows, :, self.end : self.end + n] = value_states
        window = (slice(0, self.rows), slice(None), slice(self.start, self.end + n))
        return keys[window], values[window]

    def commit(self, n: int) -> None:
        """The last forward pass's ``n`` columns are part of the window now."""
        self.end += n
        self._show()

    def reserve(self, rows: int, left: int, right: int) -> None:
        """Room for ``rows`` rows, ``left`` columns before ``end`` and ``right`` after."""
        slots, _, capacity, _ = self.buffers[0][0].shape
        if rows <= slots and left <= self.end and self.end + right <= capacity:
            return
        end = max(self.width, left)
        if rows <= slots and end + right <= capacity:
            # Only the columns ran out: slide the window back in place. Reallocating would
            # zero every buffer (all slots, whole capacity) for a copy of a few columns.
            for keys, values in self.buffers:
                for t in (keys, values):
                    window = t[: self.rows, :, self.start : self.end].clone()
                    t[: self.rows, :, end - self.width : end] = window
            self.start, self.end = end - self.width, end
            return
        slots = max(rows, min(self.max_rows, 2 * slots))
        capacity = end + right + max(64, end)  # spare: reallocate every 64+ tokens at most
        self.buffers = [(self._moved(k, slots, end, capacity), self._moved(v, slots, end, capacity))
                        for k, v in self.buffers]
        self.start, self.end = end - self.width, end

    def _moved(self, old: torch.Tensor, slots: int, end: int, capacity: int) -> torch.Tensor:
        new = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))  # finite padding
        new[: self.rows, :, end - self.width : end] = old[: self.rows, :, self.start : self.end]
        return new

    def add(self, prefilled: DynamicCache) -> None:
        """Append the rows of a fresh prefill (its columns end at ``end`` too)."""
        first = prefilled.layers[0].keys
        n, width = first.shape[0], first.shape[2]
        if not self.buffers:  # shapes, dtype and device from the first prefill
            self.buffers = [(layer.keys.new_zeros((0, *layer.keys.shape[1:])),
                             layer.values.new_zeros((0, *layer.values.shape[1:])))
                            for layer in prefilled.layers]
            self.layers = [DynamicLayer() for _ in prefilled.layers]
            for mine, theirs in zip(self.layers, prefilled.layers, strict=True):
                mine.lazy_initialization(theirs.keys, theirs.values)
        self.reserve(self.rows + n, width, 1)
        rows = slice(self.rows, self.rows + n)
        for (keys, values), layer in zip(self.buffers, prefilled.layers, strict=True):
            keys[rows, :, self.end - width : self.end] = layer.keys
            values[rows, :, self.end - width : self.end] = layer.values
        self.rows += n
        self.start = min(self.start, self.end - width)
        self._show()

    def rows_kv(self, rows: list[int], widths: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copies of the last ``widths[i]`` cached columns of each row in ``rows``, per layer
        (one gather per layer; each row's are views of it)."""
        if not rows:
            return []
        width = max(widths)
        index = torch.tensor(rows, device=self.buffers[0][0].device)
        window = slice(self.end - width, self.end)
        gathered = [(k[:, :, window].index_select(0, index), v[:, :, window].index_select(0, index))
                    for k, v in self.buffers]
        return [[(k[i, :, width - w :], v[i, :, width - w :]) for k, v in gathered]
                for i, w in enumerate(widths)]

    def retain(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep``, packed into ``[0, len(keep))`` by moving the last ones
        into the holes; returns the old row index of each new row."""
        order = [i for i in keep if i < len(keep)]
        holes = sorted(set(range(len(keep))) - set(order))
        movers = [i for i in keep if i >= len(keep)]
        if movers:
            device = self.buffers[0][0].device
            dst, src = torch.tensor(holes, device=device), torch.tensor(movers, device=device)
            for keys, values in self.buffers:
                keys[dst, :, self.start : self.end] = keys[src, :, self.start : self.end]
                values[dst, :, self.start : self.end] = values[src, :, self.start : self.end]
        new = list(range(len(keep)))
        for hole, mover in zip(holes, movers, strict=True):
            new[hole] = mover
        self.rows = len(keep)
        self._show()
        return new

    def cleared(self) -> SlotCache:
        """No rows and an empty window; the buffers stay for the next sequences."""
        self.rows = self.start = self.end = 0
        if self.buffers:
            self._show()
        return self

    def trim(self, width: int) -> None:
        """Narrow the window to its last ``width`` columns (those before hold padding)."""
        self.start = max(self.start, self.end - width)
        self._show()

    def clear(self) -> None:
        self.rows, self.start = 0, self.end
        self._show()

    def _show(self) -> None:
        for layer, (keys, values) in zip(self.layers, self.buffers, strict=True):
            layer.keys = keys[: self.rows, :, self.start : self.end]
            layer.values = values[: self.rows, :, self.start : self.end]

