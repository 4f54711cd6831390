"""Policy losses (``algo.loss``): a loss per trained token, before aggregation.

Each is a callable ``(inputs, old) -> PerToken``: ``old`` is the log-prob the ratio is taken
against, ``r_t = exp(log pi_theta - old)`` — the proximal policy's in the decoupled mode, the
engine's behaviour policy's in the bypass mode (:mod:`~orchestrator.algo.corrections`).

Every loss is registered with :func:`policy_loss` and a :class:`LossCard` (its per-token
formula, its paper, what it logs): :data:`LOSSES` is the registry, from which the table in
``docs/algorithms.md`` is generated (``python -m orchestrator.commands.config_reference``) and
which the presets test reads. Adding a loss is its class here and a YAML in ``conf/algo/``.

At a ratio of exactly 1 — the decoupled mode with one update per batch, where pi_prox is the
policy being trained — GSPO's clip, CISPO's cap, SAPO's gate and PPO's dual clip never act:
each is then the plain policy gradient. :func:`cannot_act` says so in one line at a run's
start. A loss may also name the aggregations its paper allows (:func:`check_aggregation`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from orchestrator.algo.base import LossInputs, masked_mean
from orchestrator.errors import ConfigError

L = TypeVar("L", bound=type)


@dataclass(frozen=True)
class LossCard:
    """What the docs say of a policy loss, kept beside its code."""

    formula: str  # the per-token loss; A: the advantage, r: the ratio, sg: stop-gradient
    paper: str
    logs: tuple[str, ...] = ()  # metrics per trained token, its own first
    sequence_logs: tuple[str, ...] = ()  # metrics per sequence

    @property
    def own(self) -> str:
        """The metric only this loss logs, which a run with it shows every step."""
        return (self.logs + self.sequence_logs)[0]


LOSSES: dict[str, type] = {}  # class name -> class: every registered policy loss


def policy_loss(card: LossCard) -> Callable[[L], L]:
    """Register a policy loss class (``algo.loss._target_``) with its :class:`LossCard`."""

    def register(cls: L) -> L:
        cls.card = card  # type: ignore[attr-defined]
        LOSSES[cls.__name__] = cls
        return cls

    return register


@dataclass(frozen=True)
class PerToken:
    loss: torch.Tensor  # (sequences, time), zero where not trained
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # per trained token
    sequence_metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # per sequence


def _check_clip(eps_low: float, eps_high: float, key: str = "algo.loss") -> None:
    if eps_low < 0 or eps_high < 0:
        raise ConfigError(f"{key}.eps_low and {key}.eps_high must be >= 0, got {eps_low} and "
                          f"{eps_high}")


def _needs_ratio(loss: object) -> bool:
    """Whether what sets ``loss`` apart from the plain policy gradient (a clip, a cap, a gate)
    acts only where the ratio is not 1."""
    return bool(getattr(loss, "needs_ratio", False))


def check_aggregation(loss: object, aggregation: str) -> None:
    """One line naming ``algo.aggregation`` when the loss's paper defines it with another."""
    allowed: tuple[str, ...] = getattr(loss, "aggregations", ())
    if allowed and aggregation not in allowed:
        name = type(loss).__name__
        why = getattr(loss, "aggregation_reason", "its paper defines another")
        raise ConfigError(f"algo.aggregation={aggregation} does not apply to algo.loss={name} "
                          f"({why}): set algo.aggregation={' or '.join(allowed)}")


def cannot_act(algorithm: object, updates: int) -> str | None:
    """One line saying why ``algorithm``'s policy loss computes the plain policy gradient with
    ``updates`` optimiser updates per batch (the decoupled mode at one update: every ratio is
    exactly 1), or None. An algorithm not composed of pieces has no policy loss to judge."""
    loss = getattr(algorithm, "policy_loss", None)
    if getattr(algorithm, "bypass", False) or updates > 1 or not _needs_ratio(loss):
        return None
    return (f"algo.loss={type(loss).__name__} cannot act: with trainer.num_minibatches=1 in "
            f"algo.mode=decoupled every ratio pi_theta/pi_prox is exactly 1, so its "
            f"{getattr(loss, 'acts_by', 'clip')} never binds and it trains as the plain policy "
            f"gradient; set trainer.num_minibatches > 1 or algo.mode=bypass")


@policy_loss(LossCard(
    "max(−A r, −A clip(r, 1−ε_low, 1+ε_high)); with `dual_clip` c, at most −A c when A < 0",
    "PPO; clip-higher (DAPO); dual-clip arXiv 1912.09729",
    logs=("clip_fraction", "ratio", "dual_clip_fraction")))
class PPOClip:
    """PPO's clipped surrogate with asymmetric bounds (clip-higher) and optional dual clip."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.28,
                 dual_clip: float | None = None) -> None:
        _check_clip(eps_low, eps_high)
        if dual_clip is not None and dual_clip <= 1.0:
            raise ConfigError(f"algo.loss.dual_clip must be > 1 (a bound on -A r for A < 0) "
                              f"or null, got {dual_clip}")
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip
        # at ratio 1 PPO's clip is GRPO's plain gradient, legitimately; a dual clip is then idle
        self.needs_ratio = dual_clip is not None
        self.acts_by = "dual clip"

    def __call__(self, inputs: LossInputs, old: torch.Tensor) -> PerToken:
        ratio = torch.exp(inputs.logprobs - old)
        return clipped_surrogate(ratio, inputs, self.eps_low, self.eps_high, self.dual_clip)


def clipped_surrogate(ratio: torch.Tensor, inputs: LossInputs, eps_low: float, eps_high: float,
                      dual_clip: float | None = None) -> PerToken:
    adv, mask = inputs.advantages, inputs.mask
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {"clip_fraction": masked_mean((clipped > unclipped).to(mask.dtype), mask),
                   "ratio": masked_mean(ratio.detach(), mask)}
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_fraction"] = masked_mean(dual.to(mask.dtype), mask)
    return PerToken(loss * mask, metrics)


@policy_loss(LossCard(
    "PPOClip on s = exp(mean_t log r_t), gradient of sg(s) · π_θ/sg(π_θ) per token",
    "arXiv 2507.18071", sequence_logs=("sequence_clip_fraction", "sequence_ratio")))
class GSPO:
    """Group Sequence Policy Optimisation: the clip acts on each sequence's length-normalised
    ratio, so all of a sequence's tokens are kept or clipped together (the paper's bounds are
    3e-4 and 4e-4: a sequence ratio moves far less than a token's). Its objective averages
    each sequence's tokens, then the sequences: ``algo.aggregation=sequence_mean`` only."""

    needs_ratio = True
    acts_by = "sequence clip"
    aggregations = ("sequence_mean",)
    aggregation_reason = "its objective averages each sequence's tokens, then the sequences"

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4) -> None:
        _check_clip(eps_low, eps_high)
        self.eps_low, self.eps_high = eps_low, eps_high

    def __call__(self, inputs: LossInputs, old: torch.Tensor) -> PerToken:
        log_ratio = (inputs.logprobs - old) * inputs.mask
        sequence = inputs.sequence_mean(log_ratio).detach()  # log s_i
        # value s_i at every token, gradient d log pi_theta(t) * s_i (GSPO-token's form)
        ratio = torch.exp(sequence[:, None] + inputs.logprobs - inputs.logprobs.detach())
        out = clipped_surrogate(ratio, inputs, self.eps_low, self.eps_high)
        with torch.no_grad():
            s = torch.exp(sequence)
            live = inputs.sequences
            clipped = ((s < 1 - self.eps_low) | (s > 1 + self.eps_high)).to(live.dtype)
            seq = {"sequence_clip_fraction": masked_mean(clipped, live),
                   "sequence_ratio": masked_mean(s, live)}
        return PerToken(out.loss, {"ratio": out.metrics["ratio"]}, seq)


@policy_loss(LossCard(
    "−sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ: every token keeps a gradient",
    "arXiv 2506.13585", logs=("clip_fraction",)))
class CISPO:
    """Clipped IS-weight Policy Optimisation: every token keeps a gradient, ``log pi_theta``
    weighted by its clipped, stop-gradient ratio ``clip(r, 1 - eps_low, 1 + eps_high)``, the
    paper's relative bounds (MiniMax-M1 bounds the weight from above only: ``eps_low`` of 1 or
    more leaves it unbounded below). TRL's ``epsilon_high`` is the cap itself, ``min(r, eps)``
    (5.0 recommended): here that is ``eps_high = eps - 1`` (4.0)."""

    needs_ratio = True
    acts_by = "cap on the importance weight"

    def __init__(self, eps_low: float = 1.0, eps_high: float = 0.28) -> None:
        _check_clip(eps_low, eps_high)
        self.eps_low, self.eps_high = eps_low, eps_high

    def __call__(self, inputs: LossInputs, old: torch.Tensor) -> PerToken:
        mask = inputs.mask
        with torch.no_grad():
            ratio = torch.exp(inputs.logprobs - old)
            low = max(1.0 - self.eps_low, 0.0)
            weight = ratio.clamp(low, 1.0 + self.eps_high)
            metrics = {"clip_fraction": masked_mean((weight != ratio).to(mask.dtype), mask),
                       "ratio": masked_mean(ratio, mask)}
        return PerToken(-weight * inputs.advantages * inputs.logprobs * mask, metrics)


@policy_loss(LossCard(
    "−A · (4/τ) σ(τ(r−1)), τ by the sign of A: a soft gate whose gradient is 1 at r = 1",
    "arXiv 2511.20347", logs=("gate_weight",)))
class SAPO:
    """Soft Adaptive Policy Optimisation: a smooth gate instead of a hard clip,
    ``f(r) = 4 / tau * sigmoid(tau (r - 1))`` (its gradient is 1 at r = 1 and fades as r moves
    away), with a sharper ``tau_neg`` for negative advantages."""

    needs_ratio = True
    acts_by = "gate"

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05) -> None:
        if tau_pos <= 0 or tau_neg <= 0:
            raise ConfigError(f"algo.loss.tau_pos and tau_neg must be > 0, got {tau_pos} and "
                              f"{tau_neg}")
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def __call__(self, inputs: LossInputs, old: torch.Tensor) -> PerToken:
        adv, mask = inputs.advantages, inputs.mask
        ratio = torch.exp(inputs.logprobs - old)
        tau = torch.where(adv >= 0, torch.full_like(adv, self.tau_pos),
                          torch.full_like(adv, self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        with torch.no_grad():
            g = torch.sigmoid(tau * (ratio - 1.0))
            metrics = {"gate_weight": masked_mean(4.0 * g * (1.0 - g) * ratio, mask),
                       "ratio": masked_mean(ratio, mask)}
        return PerToken(-adv * gate * mask, metrics)
