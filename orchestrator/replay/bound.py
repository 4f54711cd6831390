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

This *workload* bound is an estimate, not a guarantee: it assumes the samples a policy trains
are a fair draw of the workload. A policy that drops long samples as stale trains a cheaper
mix, and can beat it (bounded staleness k = 4 on the generated math workload reached 1.005 of
it, training 1% shorter samples on a trainer-bound workload).

**The bound of a run** (:class:`RunBound`, measured by :class:`BoundMeter`) holds by
construction, for any policy, on any workload, from what the run itself trained. Over the
steady window (report ``skip - 1`` to the last report, ``seconds`` long), with ``B_w`` samples
trained in it:

    seconds  >=  max( sum of the window's train steps,
                      sum over the turns trained in it of (w(turn) - before(turn)) / E )

where ``before(turn)`` is how long the turn had been submitted when the window opened (0 for
one submitted inside it), capped at ``w(turn)``.

so ``B_w / seconds <= B_w / max(...)``, its samples/s. It rests on three facts of the replay,
each true whatever the scheduler does: the trainer runs one step at a time, each inside the
window (it starts after the previous report; the last ends before the last report); a turn
trained before the window closes was served by then, on one replica, which spent at least
``w(turn)`` busy on it (the work above: prefill of its uncached tokens, then per token at most
``max_running`` share a decode iteration, and its own context costs ``step_per_1k_tokens``
whatever the batch) — and that share accrues at most as fast as wall time (a prefill runs
alone; a token's share of an iteration is at most the iteration), so a turn submitted
``before`` seconds ahead of the window had at most that much of it done by then; and ``E``
replicas are busy at most ``E × seconds`` in all. Dropped samples' and unfinished ones' work
is left out (work a policy spent and did not train: a loss the fraction shows), which only
lowers the right-hand side. So no policy's
steady samples/s can exceed its run bound: its fraction (``bound_frac`` in
``bench.async_replay``) is at most 1, and what it lacks of 1 is what the schedule lost — idle
or small-batch replicas, a trainer waiting, work thrown away, imbalance — on the mix it
chose to train. (Weight loads pause replicas, which only adds to their time: left out.)

What the workload bound leaves out, and so what a policy loses against it: replicas idle or decoding
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
from orchestrator.trace.recorder import Recorder
from orchestrator.types import StepReport


@dataclass(frozen=True)
class SampleCost:
    work: float  # replica-seconds at full throughput
    floor: float  # seconds alone on an idle replica, tools included
    tokens: int  # trained sequence length: prompt, generated and observation tokens


def turn_work(prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              p: ServerParams) -> float:
    """The least replica-seconds one request (a turn) costs the fitted server: its prefill,
    then per decoded token its share of an iteration at the largest batch allowed, plus its
    own context's per-token cost (the fluid model's integral)."""
    prefill = p.prefill_base + p.prefill_per_1k * max(prompt_tokens - cached_tokens, 0) / 1000.0
    n = max(1, completion_tokens)
    resident = n * prompt_tokens + n * n / 2.0
    return (prefill + n * (p.step_per_seq + p.step_base / p.max_running)
            + p.step_per_1k_tokens * resident / 1000.0)


def sample_cost(plan: EpisodePlan, p: ServerParams) -> SampleCost:
    """The cost of ``plan`` as the replay plays it (:mod:`envs.replay`, :mod:`.engine`)."""
    work = floor = 0.0
    context = plan.prompt_tokens
    for i, turn in enumerate(plan.turns):
        prefill = p.prefill_base + p.prefill_per_1k * max(context - turn.cached_tokens, 0) / 1000.0
        n = max(1, turn.completion_tokens)
        resident = n * context + n * n / 2.0  # the fluid model's integral of the context
        work += turn_work(context, turn.cached_tokens, turn.completion_tokens, p)
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


@dataclass(frozen=True)
class RunBound:
    """The bound of one run's steady window, by construction (the module's docstring)."""

    seconds: float  # the window, as measured
    samples: int  # trained in it
    train_s: float  # the window's train steps, summed
    engine_s: float  # replica work of the turns trained in it that lies inside it, over E

    @property
    def bound_s(self) -> float:
        return max(self.train_s, self.engine_s)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.bound_s if self.bound_s > 0 else float("inf")

    @property
    def fraction(self) -> float:
        """The run's steady samples/s over its bound: at most 1."""
        return self.bound_s / self.seconds

    @property
    def bound_by(self) -> str:
        return "engines" if self.engine_s >= self.train_s else "trainer"


class BoundMeter:
    """An ``on_step`` for a replay that keeps, per trained step, each trained turn's submission
    time and least work (:func:`turn_work`; floats, not the trajectories), then gives the run's
    :class:`RunBound` over the steps after the first ``skip``."""

    def __init__(self, params: ServerParams, engines: int) -> None:
        self.params = params
        self.engines = engines
        self.turns: list[list[tuple[float, float]]] = []  # per step: (submitted, work)

    def __call__(self, report: StepReport) -> None:
        self.turns.append([
            (turn.start, turn_work(turn.prompt_tokens, turn.cached_tokens,
                                   turn.completion_tokens, self.params))
            for timing in report.timings for e in timing.episodes for turn in e.turns])

    def bound(self, reports: Sequence[StepReport], recorder: Recorder, skip: int) -> RunBound:
        """The bound of steps ``skip ..`` of the run that produced ``reports`` (its recorder
        holding every span: a replay from Python)."""
        later = reports[skip:]
        if not later or len(self.turns) != len(reports):
            raise ValueError(f"need the meter's steps ({len(self.turns)}) for every report "
                             f"({len(reports)}) and some after the first {skip}")
        # The window opens at report skip - 1 (the trainer loop's start for skip 0); the next
        # step's wait for its batch starts after it, so a train step, or the work of a turn
        # submitted from then on, lies inside the window; a turn submitted earlier did at most
        # `opens - start` of its work before.
        opens = recorder.of("wait_batch")[skip].start
        train = recorder.of("train_step")[skip:len(reports)]
        work = sum(max(0.0, w - max(0.0, opens - start))
                   for step in self.turns[skip:] for start, w in step)
        return RunBound(seconds=sum(r.elapsed for r in later), samples=sum(r.samples for r in later),
                        train_s=sum(s.duration for s in train), engine_s=work / self.engines)
