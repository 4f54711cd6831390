"""What no scheduler can beat: the throughput bound of a replayed workload.

A replay's resources are ``E`` replicas of the fitted server (:mod:`.model`) and one trainer
(:class:`~orchestrator.replay.run.TrainerModel`). Whatever the policy — synchronous, any
staleness, any over-provisioning, any routing — every trained sample's work must be done on
some replica, and every step on the trainer. Per sample, from its plan alone:

* **work** ``w`` (replica-seconds): its prefills (``prefill_base`` + ``prefill_per_1k`` per
  thousand uncached prompt tokens; prefill is serial, decode stalls meanwhile) plus, per
  decoded token, its share of a decode iteration at the largest batch the server allows:
  ``step_per_seq + step_per_1k_tokens * context / 1000 + step_base / max_running``
  (``context`` the prompt plus the tokens decoded so far, integrated as the fluid model
  does). A smaller batch only adds ``step_base / batch`` per token, so no schedule spends less.
* **floor** ``l`` (seconds): its latency alone on an idle replica (batch 1): prefills, every
  token at ``step_base + step_per_seq + step_per_1k_tokens * context / 1000``, and its tool
  time. No schedule finishes the sample sooner.
* **tokens**: what the trainer processes for it (prompt, generated and observation tokens).

The bound on steady-state throughput with ``B`` samples a step, ``sync_s`` seconds of weight
load (every replica paused) and a train step of ``T(tokens)`` seconds:

    samples/s  <=  B / max(B * mean(w) / E + sync_s,  T(B * mean(tokens)))

— the replicas' busy time at full throughput, or the trainer's time, whichever is longer;
the other overlaps it at best. A synchronous step (``k = 0``) cannot overlap them, and cannot
end before its longest sample: ``max(B * mean(w) / E, mean over steps of max(l)) + sync_s +
T``; that is :attr:`Bound.sync_samples_per_s`. Asynchrony beats the floor, since a long
sample runs across steps, but with staleness ``k`` a sample must finish within about ``k``
steps of its start to be trained, so about ``max(l) / k`` a step is a floor for a policy that
trains every sample (:meth:`Bound.staleness_floor`; of the bench's policies it nearly binds
``k = 1`` on the math workload, whose longest samples take 260 s alone).

What the bound leaves out, and so what a policy loses against it: replicas idle or decoding
at small batches (the tail of a step, too few requests in flight, tool waits), work thrown
away (samples dropped as stale), imbalance between replicas, prefills repeated when an
episode changes replica, and the start of a run, before the first batch exists (the bench
compares steady-state throughput, after its first third of steps, with this steady-state
bound). Means are over the workload's samples (its distribution): a policy that drops long
samples trains a shorter mix than the workload, and may seem to beat the bound by doing so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from envs.replay import EpisodePlan
from orchestrator.replay.model import ServerParams


@dataclass(frozen=True)
class SampleCost:
    work: float  # replica-seconds at full throughput
    floor: float  # seconds alone on an idle replica, tools included
    tokens: int  # trained sequence length: prompt, generated and observation tokens


def sample_cost(plan: EpisodePlan, p: ServerParams) -> SampleCost:
    """The cost of ``plan`` as the replay plays it (:mod:`envs.replay`, :mod:`.engine`)."""
    per_token_min = p.step_per_seq + p.step_base / p.max_running
    work = floor = 0.0
    context = plan.prompt_tokens
    for i, turn in enumerate(plan.turns):
        prefill = p.prefill_base + p.prefill_per_1k * max(context - turn.cached_tokens, 0) / 1000.0
        n = max(1, turn.completion_tokens)
        resident = n * context + n * n / 2.0  # the fluid model's integral of the context
        work += prefill + n * per_token_min + p.step_per_1k_tokens * resident / 1000.0
        floor += prefill + n * (p.step_base + p.step_per_seq) + p.step_per_1k_tokens * resident / 1000.0
        context += n
        if not turn.tools or i == len(plan.turns) - 1:
            break  # the episode ends here (envs.replay.ReplayEnv.step)
        floor += sum(t.latency for t in turn.tools)  # sequential, as the replay runs them
        context += sum(t.append_tokens for t in turn.tools)
    return SampleCost(work, floor, context)


@dataclass(frozen=True)
class Bound:
    batch_size: int
    engines: int
    engine_s: float  # replica work of a mean step / E, plus the weight load
    train_s: float  # the trainer's mean step
    floor_s: float  # mean over steps of the longest sample's floor
    floor_max: float  # the longest floor of the workload

    @property
    def step_s(self) -> float:
        return max(self.engine_s, self.train_s)

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_s

    @property
    def bound_by(self) -> str:
        return "engines" if self.engine_s >= self.train_s else "trainer"

    @property
    def sync_samples_per_s(self) -> float:
        return self.batch_size / (max(self.engine_s, self.floor_s) + self.train_s)

    def staleness_floor(self, k: int) -> float:
        """Seconds a step must last for the longest sample to finish within ``k`` steps."""
        return self.floor_max / k if k > 0 else float("inf")


def workload_bound(plans: Sequence[EpisodePlan], params: ServerParams, *, engines: int,
                   batch_size: int, train_seconds: float, sync_seconds: float = 0.0) -> Bound:
    """The bound of ``plans`` (a workload, in the order a replay hands its groups out) on
    ``engines`` replicas of ``params``; ``train_seconds`` is the trainer's step on a batch of
    mean tokens (``TrainerModel.seconds``)."""
    costs = [sample_cost(p, params) for p in plans]
    work = statistics.fmean(c.work for c in costs)
    steps = [costs[i:i + batch_size] for i in range(0, len(costs) - batch_size + 1, batch_size)]
    floor_s = statistics.fmean(max(c.floor for c in step) for step in steps) if steps else 0.0
    return Bound(batch_size, engines, batch_size * work / engines + sync_seconds,
                 train_seconds, floor_s, max(c.floor for c in costs))


def mean_tokens(plans: Sequence[EpisodePlan], params: ServerParams) -> float:
    return statistics.fmean(sample_cost(p, params).tokens for p in plans)
