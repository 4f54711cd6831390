"""A micro-batch's groups packed one to a row: the shared prefix once, then every sample's
own tokens after it, with an attention mask that keeps the samples apart.

The samples of one prompt share it. Run as a right-padded batch, every row computes the
prompt again and pads to the longest sample; run in two passes (the prefixes, then the rows'
own tokens on top of their keys and values), the prompt is computed once but the second pass
still pads every row to the longest reply, which is most of it when replies are short (a
group of 8 one-digit answers next to a reply cut at 16 tokens computes 128 positions for
about 60 tokens). Packed, a group is one row ``[prefix | sample 1 | sample 2 | ...]``: each
token sits at its own position id (its column in its sample), attends to the prefix and to
the earlier tokens of its own sample only, so its keys, values and logits are those of its
sample run alone, and nothing but the gap to the longest group is padding.

The price is attention: the mask is applied to a dense ``[row, row]`` product, so a group of
long samples computes every pair between them and throws most away. :func:`packing_pays`
compares the two layouts' FLOPs (the same count as ``bench.flops``: ``2 x weights`` per
token, ``4 x heads x head size`` per attention pair and layer) and the trainer packs only
when it computes less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupPacking:
    """Model inputs with one row per group, and where each trained target's logits are."""

    input_ids: torch.Tensor  # [groups, length]
    position_ids: torch.Tensor  # [groups, length]: a token's column in its own sample
    attention: torch.Tensor  # [groups, 1, length, length] bool: query row attends to key column
    keep: torch.Tensor  # [groups, length] bool: the positions whose logits a trained target needs
    rows: torch.Tensor  # [trained targets]: each one's row among the kept logits (row-major order)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as ``transformers`` adds it to attention scores (0 or the dtype's lowest)."""
        lowest = torch.finfo(dtype).min
        return torch.zeros(self.attention.shape, dtype=dtype).masked_fill_(~self.attention, lowest)


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
    length = max(sizes)
    source_row = torch.zeros((len(packed), length), dtype=torch.long)
    source_col = torch.zeros((len(packed), length), dtype=torch.long)
    sample = torch.full((len(packed), length), -2, dtype=torch.long)  # -1: prefix, -2: padding
    slot = torch.full(trained.shape, -1, dtype=torch.long)  # the packed position target (r, t) reads
    for g, (p, rows) in enumerate(zip(shared, packed, strict=True)):
        base = g * length
        source_row[g, :p], source_col[g, :p], sample[g, :p] = rows[0], torch.arange(p), -1
        at = p
        for r in rows:
            n = lengths[r] - p
            source_row[g, at:at + n], sample[g, at:at + n] = r, r
            source_col[g, at:at + n] = torch.arange(p, p + n)
            if p:
                slot[r, p - 1] = base + p - 1  # the prefix's last token predicts every first own one
            slot[r, p:p + n] = torch.arange(base + at, base + at + n)
            at += n
    wanted = slot[trained]
    if (wanted < 0).any():
        raise ValueError("a trained target lies inside its group's shared prefix")
    keep = torch.zeros(len(packed) * length, dtype=torch.bool)
    keep[wanted] = True
    kept_row = keep.cumsum(0) - 1
    query, key = sample[:, :, None], sample[:, None, :]
    causal = torch.ones((length, length), dtype=torch.bool).tril()
    attention = causal & ((key == -1) | (key == query)) & (key != -2)
    attention |= torch.eye(length, dtype=torch.bool)  # padding sees itself: no empty row
    return GroupPacking(
        input_ids=inputs[source_row, source_col],
        position_ids=source_col,
        attention=attention[:, None],
        keep=keep.view(len(packed), length),
        rows=kept_row[wanted],
    )


def packing_pays(lengths: Sequence[int], group: Sequence[int], prefix: Sequence[int],
                 token_flops: float, pair_flops: float) -> bool:
    """Whether packing by group computes fewer FLOPs than two passes (the prefixes, then every
    row's own tokens padded to the longest), each layout counted with its padding (a masked
    attention product is dense: every query meets every key of its pass): a token costs
    ``token_flops``, an attention pair ``pair_flops``."""
    packed, shared, sizes = groups_of(group, prefix, lengths)
    longest = max(sizes)
    packed_cost = len(packed) * longest * (token_flops + pair_flops * longest)
    p = max(shared)
    own = max(lengths[r] - shared[g] for g, rows in enumerate(packed) for r in rows)
    prefix_cost = len(packed) * p * (token_flops + pair_flops * p)
    own_cost = len(lengths) * own * (token_flops + pair_flops * (p + own))
    return packed_cost < prefix_cost + own_cost
