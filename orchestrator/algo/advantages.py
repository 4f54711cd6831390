"""Advantage estimators: one advantage per sample from its group's rewards (``algo.advantage``).

Each is a callable ``(groups, rewards) -> advantages``, ``rewards[g][i]`` being the (shaped)
reward of sample ``i`` of group ``g``; every one gives exactly 0 to a group whose rewards are
all equal (no signal, and no float residue either).

| class | advantage of sample i in group g | source |
| --- | --- | --- |
| `GroupNorm` | (r - mean_g) / (std_g + eps) | GRPO (arXiv 2402.03300) |
| `GroupNorm(std="none")` | r - mean_g | Dr.GRPO (arXiv 2503.20783) |
| `GroupNorm(std="batch")` | (r - mean_g) / (std over the whole batch) | LitePPO (arXiv 2508.08221) |
| `LeaveOneOut` | r - mean of the group's other samples | RLOO (arXiv 2402.14740) |
| `BatchWhitened` | (r - mean_g), whitened over the batch | REINFORCE++ (arXiv 2501.03262) |
| `NormalizeThenSum` | each reward part group-normalised, summed with weights, whitened | GDPO; TRL's `normalize_then_sum` |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from orchestrator.errors import ConfigError
from orchestrator.types import Group

EPS = 1e-6
Rewards = Sequence[Sequence[float]]


def _flat(rewards: Rewards) -> torch.Tensor:
    return torch.tensor([r for group in rewards for r in group], dtype=torch.float64)


def _split(values: torch.Tensor, like: Rewards) -> list[list[float]]:
    out, start = [], 0
    for group in like:
        out.append(values[start:start + len(group)].tolist())
        start += len(group)
    return out


def _constant(group: Sequence[float]) -> bool:
    return len(group) == 0 or all(r == group[0] for r in group)


def _live(rewards: Rewards) -> torch.Tensor:
    """Per sample: whether its group has a signal (its rewards are not all equal)."""
    return torch.tensor([not _constant(g) for g in rewards for _ in g], dtype=torch.bool)


def centred(rewards: Rewards) -> list[list[float]]:
    """Each reward minus its group's mean; exactly 0 for a group whose rewards are equal."""
    out = []
    for group in rewards:
        r = torch.tensor(group, dtype=torch.float64)
        out.append([0.0] * len(group) if _constant(group) else (r - r.mean()).tolist())
    return out


def group_normalised(group: Sequence[float], eps: float = EPS) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group (population std), 0 if all are equal."""
    if _constant(group):
        return [0.0] * len(group)
    r = torch.tensor(group, dtype=torch.float64)
    centred_ = r - r.mean()
    return (centred_ / (r.std(unbiased=False) + eps)).tolist() if len(group) > 1 else centred_.tolist()


def whitened(advantages: Rewards, rewards: Rewards, eps: float = EPS) -> list[list[float]]:
    """``advantages`` over the whole batch: minus their mean, over their std; samples of a group
    whose rewards are all equal stay exactly 0 and are left out of the statistics."""
    flat = _flat(advantages)
    live = _live(rewards)
    if int(live.sum()) < 2:
        return [list(map(float, g)) for g in advantages]
    values = flat[live]
    flat = torch.where(live, (flat - values.mean()) / (values.std(unbiased=False) + eps),
                       torch.zeros_like(flat))
    return _split(flat, advantages)


class GroupNorm:
    """Group mean baseline, scaled by ``std``: ``"group"`` (GRPO), ``"batch"`` (LitePPO) or
    ``"none"`` (Dr.GRPO)."""

    def __init__(self, std: str = "group", eps: float = EPS) -> None:
        if std not in ("group", "batch", "none"):
            raise ConfigError(f"algo.advantage.std must be group, batch or none, got {std!r}")
        self.std = std
        self.eps = eps

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        if self.std == "group":
            return [group_normalised(g, self.eps) for g in rewards]
        advantages = centred(rewards)
        if self.std == "none":
            return advantages
        live = _live(rewards)
        if not bool(live.any()):
            return advantages
        scale = _flat(rewards)[live].std(unbiased=False) + self.eps
        return _split(_flat(advantages) / scale, advantages)


class LeaveOneOut:
    """RLOO: each sample's baseline is the mean reward of the other samples of its group,
    ``A_i = G / (G - 1) * (r_i - mean)``."""

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        out = []
        for group, c in zip(rewards, centred(rewards), strict=True):
            n = len(group)
            out.append([n / (n - 1) * a for a in c] if n > 1 else [0.0] * n)
        return out


class BatchWhitened:
    """REINFORCE++: the rewards minus the group mean (``group_baseline``, the "-baseline"
    variant for several samples per prompt) or as they are, whitened over the whole batch."""

    def __init__(self, group_baseline: bool = True, eps: float = EPS) -> None:
        self.group_baseline = group_baseline
        self.eps = eps

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        base = centred(rewards) if self.group_baseline else [list(g) for g in rewards]
        return whitened(base, rewards, self.eps)


class NormalizeThenSum:
    """GDPO: a reward made of parts (``env.reward`` as a weighted sum: each trajectory carries
    each term's value as ``reward/<term>``) gets each part group-normalised on its own, then
    summed with ``weights`` (default 1 each), then whitened over the batch (``whiten``), so a
    part with a large spread cannot drown another. What reward shaping or a KL penalty added is
    one more part, weight 1. Trajectories without parts use their reward."""

    def __init__(self, weights: Mapping[str, float] | None = None, whiten: bool = True,
                 eps: float = EPS) -> None:
        self.weights = dict(weights or {})
        self.whiten = whiten
        self.eps = eps

    def parts(self, groups: Sequence[Group]) -> list[str]:
        names = {k.removeprefix("reward/") for g in groups for t in g.trajectories
                 for k in t.metrics if k.startswith("reward/") and k.count("/") == 1}
        unknown = set(self.weights) - names
        if unknown and names:
            raise ConfigError(f"algo.advantage.weights names {sorted(unknown)}, which are not "
                              f"reward terms of this environment (its terms: {sorted(names)})")
        return sorted(names)

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        names = self.parts(groups)
        if not names:
            summed = [group_normalised(g, self.eps) for g in rewards]
        else:
            summed = [[0.0] * len(g) for g in rewards]
            for name in names:
                weight = self.weights.get(name, 1.0)
                values = [[t.metrics.get(f"reward/{name}", 0.0) for t in g.trajectories]
                          for g in groups]
                for out, part in zip(summed, values, strict=True):
                    for i, a in enumerate(group_normalised(part, self.eps)):
                        out[i] += weight * a
            # what shaping and penalties added to the rewards, as one more part
            extra = [[r - t.reward for r, t in zip(g_r, g.trajectories, strict=True)]
                     for g_r, g in zip(rewards, groups, strict=True)]
            if any(e != 0.0 for g in extra for e in g):
                for out, part in zip(summed, extra, strict=True):
                    for i, a in enumerate(group_normalised(part, self.eps)):
                        out[i] += a
        return whitened(summed, summed, self.eps) if self.whiten else summed
