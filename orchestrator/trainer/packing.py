"""A micro-batch's groups packed into one row: each group's shared prefix once, then every
sample's own tokens after it, each group's tokens attending only to one another.

The samples of one prompt share it. Run as a right-padded batch, every row computes the
prompt again and pads to the longest sample; run in two passes (the prefixes, then the rows'
own tokens on top of their keys and values), the prompt is computed once but the second pass
still pads every row to the longest reply, which is most of it when replies are short (a
group of 8 one-digit answers next to a reply cut at 16 tokens computes 128 positions for
about 60 tokens). Packed, a group is a block ``[prefix | sample 1 | sample 2 | ...]`` and the
groups follow one another in a single row, with no padding at all: each token sits at its
own position id (its column in its sample) and attends to the prefix and to the earlier
tokens of its own sample only, so its keys, values and logits are those of its sample run
alone.

Attention (:func:`group_attention`, registered with ``transformers`` as ``"group_blocks"``)
stacks the groups one to a row, padded to the longest, for one call of the model's eager
attention if it runs eager, else SDPA, under each group's mask: a token meets only its own
group's keys. So the decoder's linear layers, norms and activations (most of a step) compute
no padding, and attention, a small part, computes what one row per group would. Its price is
that the mask is applied to a dense ``[group, group]`` product, so a group of long samples
computes every pair between them and throws most away. :func:`packing_pays` compares the
two layouts' FLOPs (the same count as ``bench.flops``: ``2 x weights`` per token, ``4 x heads
x head size`` per attention pair and layer) and the trainer packs only when it computes less.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTENTION = "group_blocks"  # the model is given PASSTHROUGH_MASK: the blocks carry the masks


@dataclass(frozen=True)
class GroupBlocks:
    """The model's ``group_blocks`` argument: where each token of the row sits when the
    groups are stacked, one to a row padded to the longest (``group`` and ``column``,
    ``[length]`` each), and their additive mask (``[groups, 1, longest, longest]``; a padded
    query sees itself alone)."""

    group: torch.Tensor
    column: torch.Tensor
    mask: torch.Tensor
    inner: str


@dataclass(frozen=True)
class GroupPacking:
    """Model inputs with every group in one row, and where each trained target's logits are."""

    input_ids: torch.Tensor  # [1, length]
    position_ids: torch.Tensor  # [1, length]: a token's column in its own sample
    bounds: tuple[tuple[int, int], ...]  # each group's [start, end) in the row
    attention: tuple[torch.Tensor, ...]  # each group's [size, size] bool: query attends to key
    keep: torch.Tensor  # [1, length] bool: the positions whose logits a trained target needs
    rows: torch.Tensor  # [trained targets]: each one's row among the kept logits (row order)

    def blocks(self, dtype: torch.dtype, device: torch.device | str, inner: str) -> GroupBlocks:
        """The groups as :func:`group_attention` reads them, the mask additive in ``dtype``
        (0 or the dtype's lowest, as ``transformers`` adds masks to attention scores)."""
        longest = max(end - start for start, end in self.bounds)
        sees = torch.eye(longest, dtype=torch.bool).repeat(len(self.bounds), 1, 1)
        group, column = [], []
        for g, ((start, end), attention) in enumerate(zip(self.bounds, self.attention, strict=True)):
            sees[g, : end - start, : end - start] = attention
            group.append(torch.full((end - start,), g))
            column.append(torch.arange(end - start))
        mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)
        return GroupBlocks(*(t.to(device, non_blocking=True) for t in (
            torch.cat(group), torch.cat(column), mask[:, None])), inner)


def groups_of(group: Sequence[int], prefix: Sequence[int], lengths: Sequence[int]
              ) -> tuple[list[list[int]], list[int], list[int]]:
    """The rows of each group (groups in order of their first row), each group's shared
    prefix (its first row's) and its packed length."""
    rows: dict[int, list[int]] = {}
    for r, g in enumerate(group):
        rows.setdefault(g, []).append(r)
    packed = list(rows.values())
    shared = [prefix[members[0]] for members in packed]
    sizes = [p + sum(lengths[r] - p for r in members) for p, members in zip(shared, packed, strict=True)]
    return packed, shared, sizes


def pack_by_group(inputs: torch.Tensor, lengths: Sequence[int], trained: torch.Tensor,
                  group: Sequence[int], prefix: Sequence[int]) -> GroupPacking:
    """``inputs`` ``[rows, width]`` right-padded (row ``r``'s first ``lengths[r]`` are its
    tokens), ``trained`` ``[rows, width]`` bool (target ``t`` is token ``t + 1``), each row's
    group and its group's shared untrained prefix (0: none; the first row's is the group's)."""
    packed, shared, sizes = groups_of(group, prefix, lengths)
    length = sum(sizes)
    source_row = torch.zeros(length, dtype=torch.long)
    source_col = torch.zeros(length, dtype=torch.long)
    slot = torch.full(trained.shape, -1, dtype=torch.long)  # the packed position target (r, t) reads
    bounds, attention = [], []
    base = 0
    for p, rows, size in zip(shared, packed, sizes, strict=True):
        sample = torch.full((size,), -1, dtype=torch.long)  # -1: the prefix
        source_row[base:base + p], source_col[base:base + p] = rows[0], torch.arange(p)
        at = p
        for r in rows:
            n = lengths[r] - p
            source_row[base + at:base + at + n], sample[at:at + n] = r, r
            source_col[base + at:base + at + n] = torch.arange(p, p + n)
            if p:
                slot[r, p - 1] = base + p - 1  # the prefix's last token predicts every first own one
            slot[r, p:p + n] = torch.arange(base + at, base + at + n)
            at += n
        query, key = sample[:, None], sample[None, :]
        attention.append(torch.ones((size, size), dtype=torch.bool).tril_() & ((key == -1) | (key == query)))
        bounds.append((base, base + size))
        base += size
    wanted = slot[trained]
    if (wanted < 0).any():
        raise ValueError("a trained target lies inside its group's shared prefix")
    keep = torch.zeros(length, dtype=torch.bool)
    keep[wanted] = True
    kept_row = keep.cumsum(0) - 1
    return GroupPacking(
        input_ids=inputs[source_row, source_col][None],
        position_ids=source_col[None],
        bounds=tuple(bounds),
        attention=tuple(attention),
        keep=keep[None],
        rows=kept_row[wanted],
    )


def packing_pays(lengths: Sequence[int], group: Sequence[int], prefix: Sequence[int],
                 token_flops: float, pair_flops: float) -> bool:
    """Whether packing by group computes fewer FLOPs than two passes (the prefixes, then every
    row's own tokens padded to the longest), each layout counted with its padding (a masked
    attention product is dense: every query meets every key of its padded group or pass): a
    token costs ``token_flops``, an attention pair ``pair_flops``."""
    packed, shared, sizes = groups_of(group, prefix, lengths)
    longest = max(sizes)  # attention runs with the groups stacked, padded to the longest
    packed_cost = sum(sizes) * token_flops + len(sizes) * longest * longest * pair_flops
    p = max(shared)
    own = max(lengths[r] - shared[g] for g, rows in enumerate(packed) for r in rows)
    prefix_cost = len(packed) * p * (token_flops + pair_flops * p)
    own_cost = len(lengths) * own * (token_flops + pair_flops * (p + own))
    return packed_cost < prefix_cost + own_cost


@contextmanager
def attending_by_group(model: torch.nn.Module) -> Iterator[str]:
    """``model`` attends through :func:`group_attention` inside; yields its own attention."""
    config = model.config
    inner = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield inner
    finally:
        config._attn_implementation = inner


def group_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    group_blocks: GroupBlocks | None = None, **kwargs: Any
                    ) -> tuple[torch.Tensor, None]:
    """``transformers`` attention over a packed row (``query`` ``[1, heads, length, d]``):
    the groups stacked one to a row (padded to the longest), so each token meets only its own
    group's keys, under its group's mask, in one call of the model's eager attention if it
    runs eager, else SDPA; then back in row order. Returns ``[1, length, heads, d]``.
    Without ``group_blocks`` (the model called as any model) it is ``transformers``' SDPA."""
    if group_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    at = (group_blocks.group, group_blocks.column)
    groups, longest = group_blocks.mask.shape[0], group_blocks.mask.shape[-1]

    def stacked(t: torch.Tensor) -> torch.Tensor:  # [1, heads, length, d] -> [groups, heads, longest, d]
        rows = t.new_zeros((groups, longest, t.shape[1], t.shape[3]))
        return rows.index_put(at, t[0].transpose(0, 1)).transpose(1, 2)

    out, _ = _attention(module, group_blocks.inner)(
        module, stacked(query), stacked(key), stacked(value), group_blocks.mask, **kwargs)
    return out[at][None], None  # out: [groups, longest, heads, d]


def _attention(module: torch.nn.Module, name: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """What a block runs through for a model whose attention is ``name``: its architecture's
    own eager attention for ``"eager"``, else ``transformers``' SDPA, which takes any mask
    (flash kernels take none but a causal one)."""
    modeling = sys.modules.get(type(module).__module__) if name == "eager" else None
    return getattr(modeling, "eager_attention_forward", sdpa_attention_forward)


AttentionInterface.register(ATTENTION, group_attention)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
