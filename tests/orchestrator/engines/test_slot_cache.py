"""The torch engine's batch KV cache (orchestrator/engines/slot_cache.py) against a plain
reference: rows that join from prefills, decode columns written in place, rows that leave,
and a window that is trimmed, slid back and regrown, always showing each row's tokens."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from orchestrator.engines.slot_cache import SlotCache

LAYERS, HEADS, DIM = 2, 2, 3


def prefill(values: list[list[float]]) -> DynamicCache:
    """A prefill of ``len(values)`` rows, left-padded with zeros to the longest; each token's
    keys and values hold its number (values: negated) so every column can be checked."""
    width = max(len(v) for v in values)
    cache = DynamicCache()
    rows = torch.zeros(len(values), HEADS, width, DIM)
    for i, v in enumerate(values):
        rows[i, :, width - len(v):] = torch.tensor(v)[None, :, None]
    for layer in range(LAYERS):
        cache.update(rows + layer, -(rows + layer), layer)
    return cache


def tokens(cache: SlotCache, row: int, n: int) -> list[float]:
    """The last ``n`` cached tokens of ``row`` in every layer (checked equal) and head."""
    seen = []
    for layer_index, layer in enumerate(cache.layers):
        keys, values = layer.keys[row, :, cache.width - n:], layer.values[row, :, cache.width - n:]
        assert torch.equal(values, -keys)
        seen.append((keys[0, :, 0] - layer_index).tolist())
    assert all(s == seen[0] for s in seen)
    return seen[0]


def decode(cache: SlotCache, column: list[float]) -> None:
    """One decode step: the model writes one column through ``update``, then it is committed."""
    cache.reserve(cache.rows, 0, 1)
    new = torch.tensor(column)[:, None, None, None].expand(-1, HEADS, 1, DIM)
    for layer in range(LAYERS):
        keys, _ = cache.update(new + layer, -(new + layer), layer)
        assert keys.shape[2] == cache.width + 1  # the model attends over the window and the new column
    cache.commit(1)


def test_rows_join_decode_leave_and_keep_their_tokens() -> None:
    cache = SlotCache(max_rows=8)
    cache.add(prefill([[1, 2, 3], [4]]))
    assert cache.rows == 2 and cache.width == 3
    decode(cache, [5, 6])
    assert tokens(cache, 0, 4) == [1, 2, 3, 5] and tokens(cache, 1, 2) == [4, 6]
    cache.add(prefill([[7, 8], [9, 10, 11, 12, 13]]))  # a joining prefill wider than the window
    assert cache.rows == 4 and cache.width == 5
    decode(cache, [14, 15, 16, 17])
    assert tokens(cache, 2, 3) == [7, 8, 16] and tokens(cache, 3, 6) == [9, 10, 11, 12, 13, 17]

    moved = cache.retain([1, 3])  # rows 0 and 2 stop: row 3 moves into the hole at 0
    assert moved == [3, 1] and cache.rows == 2
    assert tokens(cache, 0, 6) == [9, 10, 11, 12, 13, 17] and tokens(cache, 1, 3) == [4, 6, 15]
    cache.trim(6)
    assert cache.width == 6
    capacity = cache.buffers[0][0].shape[2]
    for step in range(100):  # past the buffers' capacity: they are reallocated, rows kept
        decode(cache, [100 + step, 200 + step])
    assert cache.buffers[0][0].shape[2] > capacity and cache.width == 106
    assert tokens(cache, 0, 106) == [9, 10, 11, 12, 13, 17, *range(100, 200)]
    assert tokens(cache, 1, 103) == [4, 6, 15, *range(200, 300)]


def test_gathered_rows_are_copies_and_a_cleared_cache_reuses_its_buffers() -> None:
    cache = SlotCache(max_rows=4)
    cache.add(prefill([[1, 2], [3, 4, 5]]))
    (first, second) = cache.rows_kv([0, 1], [2, 3])
    assert first[0][0][0, :, 0].tolist() == [1, 2] and second[1][0][0, :, 0].tolist() == [4, 5, 6]
    buffers = cache.buffers
    assert cache.cleared().rows == 0 and cache.width == 0 and cache.buffers is buffers
    first[0][0].fill_(0)  # a copy: the cache's own buffers are untouched
    cache.add(prefill([[7]]))
    assert tokens(cache, 0, 1) == [7]
