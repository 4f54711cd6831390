"""The torch engine's batch KV cache and step attention (orchestrator/engines/slot_cache.py)
against plain references: rows that join with their prompts (or a parked prefix) in the
same step as others decode, rows that leave, a window that is trimmed, slid back and
regrown, always showing each row's tokens; and each token's attention equal to one over
its own sequence alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from orchestrator.engines.slot_cache import SlotCache, step_attention

LAYERS, HEADS, DIM = 2, 2, 3


def step(cache: SlotCache, lengths: list[int], new: list[list[float]]) -> None:
    """One step: row ``i`` brings the tokens ``new[i]`` (the last of its ``lengths[i]``).
    Each token's keys and values hold its number (values: negated) plus the layer."""
    cache.begin([len(n) for n in new], lengths)
    flat = torch.tensor([t for n in new for t in n], dtype=torch.float)[None, None, :, None].expand(1, HEADS, -1, DIM)
    for layer in range(LAYERS):
        cache.update(flat + layer, -(flat + layer), layer)
    cache.commit()


def tokens(cache: SlotCache, row: int, n: int) -> list[float]:
    """The last ``n`` cached tokens of ``row`` in every layer (checked equal) and head."""
    seen = []
    for layer, (keys, values) in enumerate(cache.buffers):
        k, v = keys[row, :, cache.end - n : cache.end], values[row, :, cache.end - n : cache.end]
        assert torch.equal(v, -k)
        seen.append((k[0, :, 0] - layer).tolist())
    assert all(s == seen[0] for s in seen)
    return seen[0]


def test_rows_join_decode_leave_and_keep_their_tokens() -> None:
    cache = SlotCache(max_rows=8)
    step(cache, [3, 1], [[1, 2, 3], [4]])  # two prompts join an empty cache
    assert cache.rows == 2 and cache.width == 3
    step(cache, [4, 2], [[5], [6]])
    assert tokens(cache, 0, 4) == [1, 2, 3, 5] and tokens(cache, 1, 2) == [4, 6]
    # two decode while two join, one wider than the window
    step(cache, [5, 3, 2, 5], [[14], [15], [7, 8], [9, 10, 11, 12, 13]])
    assert cache.rows == 4 and cache.width == 5
    assert tokens(cache, 0, 5) == [1, 2, 3, 5, 14] and tokens(cache, 1, 3) == [4, 6, 15]
    assert tokens(cache, 2, 2) == [7, 8] and tokens(cache, 3, 5) == [9, 10, 11, 12, 13]

    moved = cache.retain([1, 3])  # rows 0 and 2 stop: row 3 moves into the hole at 0
    assert moved == [3, 1] and cache.rows == 2
    assert tokens(cache, 0, 5) == [9, 10, 11, 12, 13] and tokens(cache, 1, 3) == [4, 6, 15]
    cache.trim(5)
    assert cache.width == 5
    capacity = cache.buffers[0][0].shape[2]
    for i in range(100):  # past the buffers' capacity: they are reallocated, rows kept
        step(cache, [6 + i, 4 + i], [[100 + i], [200 + i]])
    assert cache.buffers[0][0].shape[2] > capacity and cache.width == 105
    assert tokens(cache, 0, 105) == [9, 10, 11, 12, 13, *range(100, 200)]
    assert tokens(cache, 1, 103) == [4, 6, 15, *range(200, 300)]


def test_a_parked_prefix_a_copied_row_and_a_cleared_cache() -> None:
    cache = SlotCache(max_rows=4)
    step(cache, [2, 3], [[1, 2], [3, 4, 5]])
    parked = cache.rows_kv([1], [3])[0]  # copies: the cache's own buffers are untouched
    assert parked[1][0][0, :, 0].tolist() == [4, 5, 6]
    cache.retain([0])
    # row 1 resumes from its parked prefix with two new tokens, while row 0 decodes
    cache.begin([1, 2], [3, 5])
    cache.place(1, parked, 5)
    flat = torch.tensor([9.0, 6, 7])[None, None, :, None].expand(1, HEADS, -1, DIM)
    for layer in range(LAYERS):
        cache.update(flat + layer, -(flat + layer), layer)
    cache.commit()
    assert tokens(cache, 0, 3) == [1, 2, 9] and tokens(cache, 1, 5) == [3, 4, 5, 6, 7]
    cache.copy_rows([1, 1], 5)  # two samples of row 1's sequence
    assert cache.rows == 4 and tokens(cache, 3, 5) == [3, 4, 5, 6, 7]
    buffers = cache.buffers
    assert cache.cleared().rows == 0 and cache.width == 0 and cache.buffers is buffers
    step(cache, [1], [[8]])
    assert tokens(cache, 0, 1) == [8]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("lengths", "new", "joins"), [
    # two decode, a prompt, a resumed, a prompt: the first prompt is cut from the other two
    ([5, 2, 6, 4, 3], [1, 1, 6, 2, 3], 2),
    ([5, 2, 3, 4, 3], [1, 1, 3, 2, 3], 1),  # alike: one group
])
def test_each_token_attends_to_its_own_sequence_only(window: int | None, lengths: list[int],
                                                     new: list[int], joins: int) -> None:
    """Rows that decode, join with a prompt, and resume a prefix, in one step: every new
    token's attention equals a causal attention over its own sequence alone (in a sliding
    window too), with grouped-query heads, whether the joining rows attend in one padded
    group or two."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    keys = [torch.randn(kv_heads, n, dim) for n in lengths]
    values = [torch.randn(kv_heads, n, dim) for n in lengths]
    queries = [torch.randn(heads, n, dim) for n in new]
    cache = SlotCache(max_rows=8)
    # the first two rows' earlier tokens are in the cache already, as a previous step left them
    earlier = [n - 1 for n in lengths[:2]]
    cache.begin(earlier, earlier)
    flat = torch.cat([k[:, : n] for k, n in zip(keys[:2], earlier, strict=True)], dim=1)[None]
    flat_v = torch.cat([v[:, : n] for v, n in zip(values[:2], earlier, strict=True)], dim=1)[None]
    cache.update(flat, flat_v, 0)
    cache.commit()
    assert len(cache.begin(new, lengths).joins) == joins
    cache.place(3, [(keys[3][:, :2], values[3][:, :2])], lengths[3])  # a parked prefix of 2
    cache.update(torch.cat([k[:, -n:] for k, n in zip(keys, new, strict=True)], dim=1)[None],
                 torch.cat([v[:, -n:] for v, n in zip(values, new, strict=True)], dim=1)[None], 0)
    out, _ = step_attention(SimpleNamespace(layer_idx=0), torch.cat(queries, dim=1)[None],
                            None, None, None, scaling=0.5, slot_cache=cache,
                            sliding_window=window)
    expected = []
    for q, k, v, n, length in zip(queries, keys, values, new, lengths, strict=True):
        position = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None]
        mask = (key <= position) & ((key > position - window) if window else True)
        expected.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5,
                                                       enable_gqa=True).transpose(0, 1))
    torch.testing.assert_close(out[0], torch.cat(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_every_tensor_of_a_step_is_on_the_cache_device(window: int | None) -> None:
    """A step's indices and masks live on the model's device: on a GPU, a mask left on the
    host fails the step (SDPA's attn_mask, masked_fill_). The meta device stands in for it
    here: whatever is built on the host instead shows up as a CPU tensor."""
    cache = SlotCache(8, device="meta")
    cache.end = 6
    # two decoding rows, then joining rows of different sizes (two join groups)
    layout = cache.begin([1, 1, 2, 5, 6], [4, 6, 3, 5, 6])
    assert len(layout.joins) >= 1
    decode, joins = layout.masks(window)
    assert decode is not None and joins
    tensors = layout.tensors()
    assert len(tensors) >= 6 + len(joins)
    assert {t.device.type for t in tensors} == {"meta"}
