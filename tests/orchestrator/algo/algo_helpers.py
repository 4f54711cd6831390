"""Small batches for the algorithm pieces' tests: nested lists in, LossInputs and Groups out."""

from __future__ import annotations

import torch

from envs.base import RewardTerm
from orchestrator.algo.base import LossInputs
from orchestrator.types import FinishReason, Group, Trajectory


def loss_inputs(
    logprobs: list[list[float]],
    proximal: list[list[float]] | None = None,
    behaviour: list[list[float]] | None = None,
    advantages: list[float] | None = None,
    mask: list[list[float]] | None = None,
    reference: list[list[float]] | None = None,
    num_tokens: float | None = None,
    num_sequences: float = 0.0,
) -> tuple[LossInputs, torch.Tensor]:
    """LossInputs (float64) with one advantage per sequence; and the log-probs leaf (grad)."""
    rows, width = len(logprobs), len(logprobs[0])
    logp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)

    def t(values: list[list[float]] | None, default: list[list[float]]) -> torch.Tensor:
        return torch.tensor(values if values is not None else default, dtype=torch.float64)

    prox = t(proximal, logprobs)
    m = t(mask, [[1.0] * width] * rows)
    adv = torch.tensor(advantages if advantages is not None else [1.0] * rows,
                       dtype=torch.float64)[:, None].expand(rows, width)
    return LossInputs(
        logprobs=logp, proximal_logprobs=prox,
        behaviour_logprobs=t(behaviour, prox.tolist()), advantages=adv, mask=m,
        num_tokens=float(m.sum()) if num_tokens is None else num_tokens,
        num_sequences=num_sequences,
        reference_logprobs=None if reference is None else t(reference, reference),
    ), logp


def trajectory(reward: float, index: int = 0, generated: int = 2,
               finish: FinishReason = FinishReason.STOP, max_tokens: int = 0,
               metrics: dict[str, float] | None = None,
               terms: tuple[RewardTerm, ...] = ()) -> Trajectory:
    n = generated + 1
    return Trajectory(0, index, tuple(range(n)), (False, *[True] * generated), (0.0,) * n,
                      (0,) * n, reward, 0, finish, metrics=dict(metrics or {}),
                      max_tokens=max_tokens, reward_terms=terms)


def groups(rewards: list[list[float]]) -> list[Group]:
    return [Group(g, tuple(trajectory(r, i) for i, r in enumerate(rs)), 0)
            for g, rs in enumerate(rewards)]
