"""The resident batch's KV cache for :mod:`orchestrator.engines.torch_engine`, and the
attention of its one-pass steps.

:class:`SlotCache` keeps, per layer, key and value buffers ``[slots, heads, capacity,
head_dim]``: row ``i`` is a resident sequence, and columns ``[start, end)`` the window that
holds every row's cached tokens, right-aligned (left padding). A step is one forward pass
over a flat run of tokens, each row's new ones after the other's (:class:`StepLayout`): a
decoding row brings its last sampled token, a joining row its prompt (or, resumed from the
prefix cache, its new tokens on top of its parked prefix), and every row's new tokens end
at column ``end``. The model's linear layers see one ``[1, tokens, hidden]`` batch, with no
padding, whatever mix of decoding and joining rows the step holds; only the attention is
per row (:func:`step_attention`, registered with ``transformers`` as ``"slot_step"``), in
two batched calls: the rows with one new token, and the others padded to the most new
tokens.

Limits: plain full-attention key/value layers (a sliding window is applied in the mask,
the columns are kept in full); no soft-capped attention logits nor attention sinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTENTION = "slot_step"


class _Join:
    """Rows ``[first, last)`` of a step that bring several tokens each, attended in one
    call with their queries right-aligned and padded to the most of them (``queries``),
    over the last ``width`` columns."""

    def __init__(self, first: int, new: Sequence[int], lengths: Sequence[int],
                 device: torch.device) -> None:
        self.first, self.last = first, first + len(new)
        self.width, self.queries, self.tokens = max(lengths), max(new), sum(new)
        valid = torch.arange(self.queries) >= self.queries - torch.tensor(new)[:, None]
        # (row, query) of each token: found on the host (nonzero on a GPU waits for it)
        self.at = tuple(i.to(device, non_blocking=True) for i in valid.nonzero(as_tuple=True))
        self.valid = valid.to(device, non_blocking=True)


def _cut(new: Sequence[int], lengths: Sequence[int]) -> int:
    """Where to cut rows bringing ``new`` tokens each into two padded groups (0: none): the
    cut that least pads (rows x most new tokens x widest row, summed), if it saves a
    quarter."""
    n = len(new)
    head_q, head_w = list(accumulate(new, max)), list(accumulate(lengths, max))  # rows [0, i]
    tail_q = list(accumulate(reversed(new), max))[::-1]  # rows [i, n)
    tail_w = list(accumulate(reversed(lengths), max))[::-1]
    whole = n * head_q[-1] * head_w[-1]
    best, cut = whole, 0
    for i in range(1, n):
        cost = i * head_q[i - 1] * head_w[i - 1] + (n - i) * tail_q[i] * tail_w[i]
        if cost < best:
            best, cut = cost, i
    return cut if 4 * best <= 3 * whole else 0


class StepLayout:
    """Where one step's tokens go. Row ``i`` (of ``rows``) brings ``new[i]`` tokens, the
    last of its ``lengths[i]``: they are its columns up to the step's column ``end``
    (inclusive), and flat tokens ``[sum(new[:i]), sum(new[:i+1]))``. The leading rows with
    one new token each (``split`` of them: the decoding ones) attend in one batched call;
    the rest in one or two (``joins``), their queries padded to their group's most new
    tokens: two when cutting them where the new tokens jump (resumed turns, then prompts,
    as the engine orders them) saves a quarter of the padded work."""

    def __init__(self, end: int, new: Sequence[int], lengths: Sequence[int],
                 device: torch.device | str = "cpu") -> None:
        self.end, self.rows = end, len(new)
        self.device = device = torch.device(device)
        split = 0
        while split < len(new) and new[split] == 1:
            split += 1
        self.split = split
        self.tokens = sum(new)
        # Every tensor of the step lives on the model's device: built from these lists on the
        # host and copied once, so the step itself never waits on a host-built mask.
        self.last = _on(torch.tensor(new).cumsum(0) - 1, device)  # each row's last token, flat
        self._lengths = _on(torch.tensor(lengths), device)
        self._masks: dict[int | None, tuple[torch.Tensor | None, list[torch.Tensor]]] = {}
        self.decode_width = max(lengths[:split], default=0)
        self.joins: list[_Join] = []
        if split < len(new):
            cut = _cut(new[split:], lengths[split:])
            self.joins = [_Join(split + a, new[split + a : split + b], lengths[split + a : split + b],
                                device)
                          for a, b in ((0, cut), (cut, len(new) - split)) if a < b]
            counts = torch.tensor(new[split:])
            within = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)
            self.join_rows = _on(torch.arange(split, len(new)).repeat_interleave(counts), device)
            self.join_columns = _on(end + 1 - counts.repeat_interleave(counts) + within, device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step reads (its indices and, once built, its masks)."""
        out = [self.last, self._lengths]
        if self.joins:
            out += [self.join_rows, self.join_columns]
        for join in self.joins:
            out += [join.valid, *join.at]
        for decode, joins in self._masks.values():
            out += ([decode] if decode is not None else []) + joins
        return out

    def masks(self, window: int | None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Boolean masks (True: attend) of the decoding rows ``[split, 1, 1, decode_width]``
        and of each join group ``[rows, 1, queries, width]``, under a sliding ``window`` if
        the layer has one."""
        if window not in self._masks:
            decode = self._mask(0, self.split, 1, self.decode_width, window)
            joins = []
            for join in self.joins:  # padded queries see any row: finite, then dropped
                mask = self._mask(join.first, join.last, join.queries, join.width, window)
                assert mask is not None
                joins.append(mask | ~join.valid[:, None, :, None])
            self._masks[window] = decode, joins
        return self._masks[window]

    def _mask(self, first: int, last: int, queries: int, width: int,
              window: int | None) -> torch.Tensor | None:
        if first == last:
            return None
        arange = torch.arange(max(width, queries), device=self.device)
        key = (self.end + 1 - width + arange[:width])[None, None, :]
        query = (self.end + 1 - queries + arange[:queries])[None, :, None]
        start = (self.end + 1 - self._lengths[first:last])[:, None, None]
        mask = (key >= start) & (key <= query)
        if window is not None:
            mask &= key > query - window
        return mask[:, None]


class SlotCache(DynamicCache):
    """A batch KV cache written in place, for rows that come and go.

    Rows ``[0, rows)`` are the resident sequences and columns ``[start, end)`` the window
    that holds them. A step (:meth:`begin`, the forward pass, :meth:`commit`) writes each
    row's new tokens through :meth:`update` into its columns ending at ``end``, in place
    (``DynamicCache`` concatenates, copying the whole cache every token); a row that leaves
    is overwritten by one of the last rows; trimming moves ``start``. Buffers are
    reallocated, with room to spare, only when rows run out (or columns, and sliding the
    window back does not make room); a drained batch's buffers serve the next one.
    """

    def __init__(self, max_rows: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.max_rows = max_rows
        self.device = torch.device(device)  # the model's: buffers and step layouts live there
        self.rows = self.start = self.end = 0
        self.slots = self.capacity = 0  # the buffers' size (their next size before the first)
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layout: StepLayout | None = None

    @property
    def width(self) -> int:
        return self.end - self.start

    # -- a step ---------------------------------------------------------------------------

    def begin(self, new: Sequence[int], lengths: Sequence[int]) -> StepLayout:
        """Lay out a step: rows ``[0, len(new))`` (the resident ones first, then those that
        join now), each bringing ``new[i]`` of its ``lengths[i]`` tokens."""
        self.reserve(len(new), max(lengths) - 1, 1)
        self.rows = len(new)
        self.start = min(self.start, self.end + 1 - max(lengths))
        self.layout = StepLayout(self.end, new, lengths, self.device)
        return self.layout

    def place(self, row: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Row ``row`` starts from a parked prefix (per layer ``[heads, n, head_dim]``): its
        first ``n`` of ``length`` tokens, placed so its last token lands at ``end``."""
        for layer, (k, v) in enumerate(kv):
            keys, values = self._buffers(layer, k)
            first = self.end + 1 - length
            keys[row, :, first : first + k.shape[1]] = k
            values[row, :, first : first + v.shape[1]] = v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's write of one layer's new keys and values (``[1, heads, tokens,
        head_dim]``, flat), each row's into its columns; :func:`step_attention` reads them
        back from the buffers."""
        layout = self.layout
        assert layout is not None, "SlotCache.update outside a step (begin ... commit)"
        keys, values = self._buffers(layer_idx, key_states[0, :, 0])
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [tokens, heads, d]
        split = layout.split
        if split:
            keys[:split, :, self.end] = k[:split]
            values[:split, :, self.end] = v[:split]
        if split < layout.rows:
            keys[layout.join_rows, :, layout.join_columns] = k[split:]
            values[layout.join_rows, :, layout.join_columns] = v[split:]
        return key_states, value_states

    def commit(self) -> None:
        """The step's column is part of the window now."""
        self.end += 1
        self.layout = None

    def copy_rows(self, sources: Sequence[int], width: int) -> None:
        """Append copies of rows ``sources``' last ``width`` columns (a group's samples
        share their prompt's cache)."""
        if not sources:
            return
        self.reserve(self.rows + len(sources), width, 0)
        index = _on(torch.tensor(sources), self.device)
        rows = slice(self.rows, self.rows + len(sources))
        for keys, values in self.buffers:
            keys[rows, :, self.end - width : self.end] = keys[index, :, self.end - width : self.end]
            values[rows, :, self.end - width : self.end] = values[index, :, self.end - width : self.end]
        self.rows += len(sources)

    # -- room -----------------------------------------------------------------------------

    def reserve(self, rows: int, left: int, right: int) -> None:
        """Room for ``rows`` rows, ``left`` columns before ``end`` and ``right`` after."""
        if rows <= self.slots and left <= self.end and self.end + right <= self.capacity:
            return
        end = max(self.width, left)
        if rows <= self.slots and end + right <= self.capacity:
            # Only the columns ran out: slide the window back in place. Reallocating would
            # zero every buffer (all slots, whole capacity) for a copy of a few columns.
            for keys, values in self.buffers:
                for t in (keys, values):
                    window = t[: self.rows, :, self.start : self.end].clone()
                    t[: self.rows, :, end - self.width : end] = window
            self.start, self.end = end - self.width, end
            return
        slots = max(rows, min(self.max_rows, 2 * self.slots))
        capacity = end + right + max(64, end)  # spare: reallocate every 64+ tokens at most
        self.buffers = [(self._moved(k, slots, end, capacity), self._moved(v, slots, end, capacity))
                        for k, v in self.buffers]
        self.slots, self.capacity = slots, capacity
        self.start, self.end = end - self.width, end

    def _moved(self, old: torch.Tensor, slots: int, end: int, capacity: int) -> torch.Tensor:
        new = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))  # finite padding
        new[: self.rows, :, end - self.width : end] = old[: self.rows, :, self.start : self.end]
        return new

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s buffers, allocated on first use from ``like`` (``[heads,
        ..., head_dim]``: their heads, head size, dtype and device)."""
        while len(self.buffers) <= layer:
            shape = (self.slots, like.shape[0], self.capacity, like.shape[-1])
            self.buffers.append((like.new_zeros(shape), like.new_zeros(shape)))
        return self.buffers[layer]

    # -- rows leaving ---------------------------------------------------------------------

    def rows_kv(self, rows: list[int], widths: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copies of the last ``widths[i]`` cached columns of each row in ``rows``, per layer
        (one gather per layer; each row's are views of it)."""
        if not rows:
            return []
        width = max(widths)
        index = _on(torch.tensor(rows), self.device)
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
        window = slice(self.start, self.end)
        for keys, values in self.buffers:  # a copy per row: an index would gather, then scatter
            for hole, mover in zip(holes, movers, strict=True):
                keys[hole, :, window] = keys[mover, :, window]
                values[hole, :, window] = values[mover, :, window]
        new = list(range(len(keep)))
        for hole, mover in zip(holes, movers, strict=True):
            new[hole] = mover
        self.rows = len(keep)
        return new

    def cleared(self) -> SlotCache:
        """No rows and an empty window; the buffers stay for the next sequences."""
        self.rows = self.start = self.end = 0
        return self

    def trim(self, width: int) -> None:
        """Narrow the window to its last ``width`` columns (those before hold padding)."""
        self.start = max(self.start, self.end - width)

    def clear(self) -> None:
        self.rows, self.start = 0, self.end


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (built on the host) on ``device``: as is on the CPU, else one asynchronous copy."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float | None = None, dropout: float = 0.0,
                   slot_cache: SlotCache | None = None, sliding_window: int | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``transformers`` attention for a :class:`SlotCache` step: ``query`` is ``[1, heads,
    tokens, head_dim]``, every row's new tokens in turn; each attends to its own row's
    columns (causally within the new ones). Returns ``[1, tokens, heads, head_dim]``.
    Outside a step (the engine's model called as any model) it is ``transformers``' SDPA
    attention."""
    if slot_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the torch engine's attention has no {name}; use engine=vllm")
    layout = slot_cache.layout
    assert layout is not None, "a SlotCache step's attention outside begin ... commit"
    keys, values = slot_cache.buffers[module.layer_idx]
    decode_mask, join_masks = layout.masks(sliding_window)
    q = query[0].transpose(0, 1)  # [tokens, heads, d]
    out = torch.empty_like(q)
    end, split = layout.end, layout.split
    if split:
        window = slice(end + 1 - layout.decode_width, end + 1)
        out[:split] = _one_query(q[:split], keys[:split, :, window], values[:split, :, window],
                                 decode_mask, scaling)
    flat = split  # the join groups' tokens follow the decoding rows'
    for join, mask in zip(layout.joins, join_masks, strict=True):
        tokens = join.tokens
        window = slice(end + 1 - join.width, end + 1)
        padded = q.new_zeros((join.last - join.first, join.queries, *q.shape[1:]))
        padded[join.at] = q[flat : flat + tokens]
        rows = slice(join.first, join.last)
        joined = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys[rows, :, window], values[rows, :, window],
            attn_mask=mask, scale=scaling, enable_gqa=True)
        out[flat : flat + tokens] = joined.transpose(1, 2)[join.at]
        flat += tokens
    return out[None], None


def _one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float | None) -> torch.Tensor:
    """Attention of one query per row (``q`` ``[rows, heads, d]``) over its row of ``keys``
    and ``values`` (``[rows, kv_heads, width, d]``), where ``mask`` (``[rows, 1, 1, width]``)
    is True; query head ``h`` reads key head ``h // (heads // kv_heads)``. Two batched
    matmuls with each key head's queries together, where SDPA would take each row's single
    query as a sequence of length one (docs/real-model.md has what it saves on CPU)."""
    rows, heads, d = q.shape
    kv_heads = keys.shape[1]
    scores = torch.matmul(q.view(rows, kv_heads, heads // kv_heads, d), keys.transpose(-1, -2))
    scores.mul_(d**-0.5 if scale is None else scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values).view(rows, heads, d)


AttentionInterface.register(ATTENTION, step_attention)
# Outside a step the model builds the masks SDPA takes; a step passes
# orchestrator.models.policy.PASSTHROUGH_MASK (its attention reads the layout).
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
