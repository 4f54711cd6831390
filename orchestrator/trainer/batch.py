"""The batch a train step works on: every per-token field right-padded to one width, each a
named tensor that slicing rows carries (:meth:`TokenBatch.slice`).

:func:`token_batch` lays sequences out this way; :func:`shared_prefix` finds the tokens a
group's samples share. How a group's rows may then be put into one row, a block each, is
:mod:`~orchestrator.trainer.packing`'s business (the one meaning of "packing" here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from orchestrator.types import Group


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded next-token tensors: position ``t`` predicts ``targets[:, t]``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor  # float: 1.0 where the target token is trained
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    on_policy: torch.Tensor  # float: 1.0 where a trained token was sampled by the current weights
    group: torch.Tensor  # long, per row: the rows of a group may share a prefix
    prefix: torch.Tensor  # long, per row: its group's shared, untrained prefix (0: none)
    sample: torch.Tensor  # long, per row: its sample's index among the step's (every rank's)
    # computed before the step's first update, on the trainer's device (None: not needed):
    proximal_logprobs: torch.Tensor | None = None  # the policy's at the step's start
    reference_logprobs: torch.Tensor | None = None  # the frozen reference policy's

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def slice(self, rows: slice) -> TokenBatch:
        """These rows of every field (fields travel by name: a new one needs no edit here)."""
        return TokenBatch(**{f.name: None if (value := getattr(self, f.name)) is None
                             else value[rows] for f in fields(self)})

    def with_advantages(self, values: torch.Tensor,
                        trained: torch.Tensor | None = None) -> TokenBatch:
        """Each row's advantage taken by its :attr:`sample` index from ``values`` (one per
        sample of the step, as :meth:`~orchestrator.algo.base.Advantages.per_sample` gives
        them); rows whose sample is not ``trained`` lose their mask (and are not counted)."""
        width = self.mask.shape[1]
        adv = values.to(torch.float32)[self.sample][:, None].expand(-1, width).contiguous()
        if trained is None:
            return replace(self, advantages=adv)
        keep = trained.to(torch.float32)[self.sample][:, None]
        return replace(self, advantages=adv, mask=self.mask * keep,
                       on_policy=self.on_policy * keep)


def shared_prefix(sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]]) -> int:
    """How many leading tokens every sequence of a group has in common with no trained token
    among them (the prompt, for samples of one prompt), leaving each at least one to predict."""
    limit = min(len(s) for s in sequences) - 1
    for m in masks:
        limit = min(limit, next((i for i, trained in enumerate(m) if trained), len(m)))
    first = sequences[0]
    n = 0
    while n < limit and all(s[n] == first[n] for s in sequences):
        n += 1
    return n


def token_batch(
    sequences: Sequence[Sequence[int]],
    masks: Sequence[Sequence[bool]],
    pad_id: int,
    behaviour: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    on_policy: Sequence[Sequence[bool]] | None = None,
    group: Sequence[int] | None = None,
    prefix: Sequence[int] | None = None,
    sample: Sequence[int] | None = None,
) -> TokenBatch:
    """The batch of these sequences: each right-padded to the longest less one, its inputs
    and the targets one position on; per token its trained mask, behaviour log-prob and
    whether the current weights sampled it; per row its advantage, group, shared prefix and
    sample index (defaults: zeros, a group each, no prefix, the row's own index)."""
    width = max(len(s) for s in sequences) - 1
    n = len(sequences)

    def padded(rows: Sequence[Sequence[Any]], fill: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([[*r, *[fill] * (width + 1 - len(r))] for r in rows], dtype=dtype)

    ids = padded(sequences, pad_id, torch.long)
    mask = padded(masks, False, torch.float32)
    behav = padded(behaviour, 0.0, torch.float32) if behaviour is not None else torch.zeros((n, width + 1))
    current = padded(on_policy, False, torch.float32) if on_policy is not None else torch.zeros((n, width + 1))
    lengths = torch.tensor([len(s) for s in sequences])
    attention = (torch.arange(width) < lengths[:, None] - 1).long()
    adv = torch.tensor(advantages if advantages is not None else [0.0] * n, dtype=torch.float32)
    return TokenBatch(
        inputs=ids[:, :-1],
        targets=ids[:, 1:],
        attention=attention,
        mask=mask[:, 1:],
        behaviour_logprobs=behav[:, 1:],
        advantages=adv[:, None].expand(n, width).contiguous(),
        on_policy=current[:, 1:] * mask[:, 1:],
        group=torch.tensor(group if group is not None else range(n), dtype=torch.long),
        prefix=torch.tensor(prefix if prefix is not None else [0] * n, dtype=torch.long),
        sample=torch.tensor(sample if sample is not None else range(n), dtype=torch.long),
    )


def generation_cap(groups: Sequence[Group]) -> float | None:
    """The largest ``max_tokens`` these groups' samples were generated with (None: none
    says), computed over every group of a step so every rank's loss divides alike."""
    caps = [t.max_tokens for g in groups for t in g.trajectories if t.max_tokens]
    return float(max(caps)) if caps else None
