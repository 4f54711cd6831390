"""Advantage estimators: one advantage per sample from its group's rewards (``algo.advantage``).

Each is a callable ``(groups, rewards) -> advantages``, ``rewards[g][i]`` being the reward of
sample ``i`` of group ``g`` after shaping and any KL penalty. Every estimator with a group
baseline gives exactly 0 to a group whose rewards are all equal (no signal, and no float
residue either); ``BatchWhitened(group_baseline=False)`` has no group baseline, so only a
batch whose rewards are all equal gets exactly 0 there.

| class | advantage of sample i in group g | source |
| --- | --- | --- |
| `GroupNorm` | (r - mean_g) / (std_g + eps), sample std | GRPO (arXiv 2402.03300); verl, TRL |
| `GroupNorm(std="none")` | r - mean_g | Dr.GRPO (arXiv 2503.20783) |
| `GroupNorm(std="batch")` | (r - mean_g) / (sample std of every reward of the batch + eps) | LitePPO (arXiv 2508.08221); ROLL, TRL |
| `LeaveOneOut` | r - mean of the group's other samples | RLOO (arXiv 2402.14740) |
| `BatchWhitened` | r - mean_g, whitened over every sample of the batch (population std) | REINFORCE++-baseline (arXiv 2501.03262); OpenRLHF |
| `BatchWhitened(group_baseline=False)` | r, whitened over every sample of the batch | REINFORCE++ |
| `NormalizeThenSum` | each reward term group-normalised, summed with weights, whitened | GDPO (arXiv 2601.05242); TRL's `normalize_then_sum` |

Every estimator but ``BatchWhitened(group_baseline=False)`` needs groups of at least 2
samples (:meth:`check`): with one sample each advantage would be 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from orchestrator.errors import ConfigError
from orchestrator.types import Group, Trajectory

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


def _zeros(like: Rewards) -> list[list[float]]:
    return [[0.0] * len(g) for g in like]


def _needs_groups(estimator: str, group_size: int) -> None:
    if group_size < 2:
        raise ConfigError(
            f"algo.advantage={estimator} needs rollout.group_size >= 2 (a group of one sample is "
            f"its own baseline: every advantage would be 0): raise rollout.group_size, "
            f"or use algo.advantage='{{_target_: orchestrator.algo.advantages.BatchWhitened, "
            f"group_baseline: false}}' (REINFORCE++ without a baseline)")


def centred(rewards: Rewards) -> list[list[float]]:
    """Each reward minus its group's mean; exactly 0 for a group whose rewards are equal."""
    out = []
    for group in rewards:
        r = torch.tensor(group, dtype=torch.float64)
        out.append([0.0] * len(group) if _constant(group) else (r - r.mean()).tolist())
    return out


def group_normalised(group: Sequence[float], eps: float = EPS) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group, with the sample std (n - 1, as verl and
    TRL); 0 if all are equal (a group of one sample included)."""
    if _constant(group):
        return [0.0] * len(group)
    r = torch.tensor(group, dtype=torch.float64)
    return ((r - r.mean()) / (r.std(unbiased=True) + eps)).tolist()


def whitened(values: Rewards, eps: float = EPS, unbiased: bool = False,
             constant_groups_zero: bool = True) -> list[list[float]]:
    """``values`` over every sample of the batch: minus their mean, over their std (population,
    or sample with ``unbiased``) plus ``eps``. All exactly 0 if the values are all equal; with
    ``constant_groups_zero``, a group whose values are all equal (0 after a group baseline:
    then the batch mean is 0 too, up to float residue) stays exactly 0."""
    flat = _flat(values)
    if _constant(flat.tolist()) or flat.numel() < 2:
        return _zeros(values)
    out = _split((flat - flat.mean()) / (flat.std(unbiased=unbiased) + eps), values)
    if constant_groups_zero:
        out = [[0.0] * len(g) if _constant(v) else g for g, v in zip(out, values, strict=True)]
    return out


class GroupNorm:
    """Group mean baseline, scaled by ``std``: ``"group"`` (GRPO), ``"batch"`` (LitePPO) or
    ``"none"`` (Dr.GRPO)."""

    def __init__(self, std: str = "group", eps: float = EPS) -> None:
        if std not in ("group", "batch", "none"):
            raise ConfigError(f"algo.advantage.std must be group, batch or none, got {std!r}")
        self.std = std
        self.eps = eps

    def check(self, group_size: int) -> None:
        _needs_groups(f"GroupNorm(std={self.std})", group_size)

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        if self.std == "group":
            return [group_normalised(g, self.eps) for g in rewards]
        advantages = centred(rewards)
        flat = _flat(rewards)
        if self.std == "none" or flat.numel() < 2 or _constant(flat.tolist()):
            return advantages
        # every reward of the batch, all-equal groups included (ROLL, TRL)
        scale = flat.std(unbiased=True) + self.eps
        return _split(_flat(advantages) / scale, advantages)


class LeaveOneOut:
    """RLOO: each sample's baseline is the mean reward of the other samples of its group,
    ``A_i = G / (G - 1) * (r_i - mean)``."""

    def check(self, group_size: int) -> None:
        _needs_groups("LeaveOneOut", group_size)

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        out = []
        for group, c in zip(rewards, centred(rewards), strict=True):
            n = len(group)
            out.append([n / (n - 1) * a for a in c] if n > 1 else [0.0] * n)
        return out


class BatchWhitened:
    """REINFORCE++: the rewards minus the group mean (``group_baseline``, the "-baseline"
    variant for several samples per prompt) or as they are, whitened over every sample of the
    batch with the population std (OpenRLHF's normalisation). Without a group baseline a group
    of equal rewards is not 0: only its place in the batch counts, which is the point at group
    size 1."""

    def __init__(self, group_baseline: bool = True, eps: float = EPS) -> None:
        self.group_baseline = group_baseline
        self.eps = eps

    def check(self, group_size: int) -> None:
        if self.group_baseline:
            _needs_groups("BatchWhitened(group_baseline=true)", group_size)

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        if self.group_baseline:
            return whitened(centred(rewards), self.eps)
        return whitened(rewards, self.eps, constant_groups_zero=False)


def _term_values(t: Trajectory) -> dict[str, tuple[float, float]]:
    return {term.name: (term.weight, term.value) for term in t.reward_terms}


class NormalizeThenSum:
    """GDPO: a reward that is a weighted sum of terms (``env.reward={math: 1.0, format: 0.1}``;
    each trajectory carries them as ``reward_terms``) gets each term group-normalised on its own
    (sample std), then summed with the terms' weights (``env.reward``'s; ``weights`` overrides
    them by name), then whitened over every sample of the batch (``whiten``, sample std, as
    TRL), so a term with a large spread cannot drown another. Diagnostics an environment logs
    beside its terms are never parts. A sample without a term counts it as 0; a batch without
    any terms (a reward that is a single number) uses the totals as its one term.

    What is in the reward but not in a term — step rewards, reward shaping, a KL penalty in the
    reward — is centred within its group and added to the sum unscaled, before whitening: its
    coefficient keeps its effect (normalising it apart would cancel ``kl.coef``)."""

    def __init__(self, weights: Mapping[str, float] | None = None, whiten: bool = True,
                 eps: float = EPS) -> None:
        self.weights = {str(k): float(v) for k, v in (weights or {}).items()}
        self.whiten = whiten
        self.eps = eps

    def check(self, group_size: int) -> None:
        _needs_groups("NormalizeThenSum", group_size)

    def parts(self, groups: Sequence[Group]) -> list[str]:
        names = list(dict.fromkeys(term.name for g in groups for t in g.trajectories
                                   for term in t.reward_terms))
        unknown = set(self.weights) - set(names)
        if unknown and names:
            raise ConfigError(f"algo.advantage.weights names {sorted(unknown)}, which are not "
                              f"reward terms of this environment (its terms: {sorted(names)})")
        return names

    def __call__(self, groups: Sequence[Group], rewards: Rewards) -> list[list[float]]:
        names = self.parts(groups)
        summed = _zeros(rewards)
        residual: list[list[float]] = []  # what the reward holds beyond its terms
        if not names:
            summed = [group_normalised([t.reward for t in g.trajectories], self.eps)
                      for g in groups]
            residual = [[r - t.reward for r, t in zip(g_r, g.trajectories, strict=True)]
                        for g_r, g in zip(rewards, groups, strict=True)]
        else:
            terms = [[_term_values(t) for t in g.trajectories] for g in groups]
            for name in names:
                for out, g_terms in zip(summed, terms, strict=True):
                    values = [ts.get(name, (0.0, 0.0))[1] for ts in g_terms]
                    # the term's weight in env.reward (every sample that has it has the same)
                    weight = self.weights.get(name, next(
                        (ts[name][0] for ts in g_terms if name in ts), 0.0))
                    for i, a in enumerate(group_normalised(values, self.eps)):
                        out[i] += weight * a
            for g_r, g_terms in zip(rewards, terms, strict=True):
                residual.append([r - sum(w * v for w, v in ts.values())
                                 for r, ts in zip(g_r, g_terms, strict=True)])
        for out, part in zip(summed, centred(residual), strict=True):
            for i, a in enumerate(part):
                out[i] += a
        return whitened(summed, self.eps, unbiased=True) if self.whiten else summed
