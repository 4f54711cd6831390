"""Evaluation on held-out tasks through the same episode runner as training (an agent env's
episodes through a gateway opened for the evaluation): ``eval.n`` samples per task at
``eval.temperature``, scored per data source and over all tasks into an
:class:`~orchestrator.types.Evaluation`.

The figures, for a set of tasks each sampled ``n`` times (a sample is *correct* when its reward
reaches ``eval.success_threshold``):

* **mean@n** — the mean reward over every sample (``n = 1`` at temperature 0: greedy
  accuracy, the headline a run has always reported);
* **std@n** — the standard deviation of a task's ``n`` rewards, averaged over the tasks (0 at
  ``n = 1``): how much sampling changes the outcome;
* **pass@k** — the chance that at least one of ``k`` samples drawn without replacement from a
  task's ``n`` is correct, ``1 − C(n−c, k) / C(n, k)`` with ``c`` correct (the unbiased
  estimator of Chen et al. 2021), averaged over the tasks;
* **maj@n** — the majority vote: each task's most common answer among its samples scores the
  mean reward of the samples that gave it, 0 when no sample gave an answer; averaged over the
  tasks. Answers are read and grouped by the environment's :meth:`~envs.base.EnvSpec.votes`:
  for ``env.reward``, by that reward's own reading and equivalence (:mod:`envs.votes`:
  math-verify for ``math``, so ``\\frac{1}{2}`` and ``0.5`` are one answer; the letter for
  ``choice``; normalised text for ``exact``; a user's function scoring one sample's reply
  against another's answer). The largest group wins; ties go to the group whose first sample
  came first. Not reported where no sample gave an answer (``code``, whose replies are
  programs);
* **response_tokens** — the mean number of generated tokens per sample.

Every figure carries its **standard error** over tasks (``<figure>_se``): the tasks are the
sample, a task's ``n`` samples are not independent of each other. For a mean over tasks
(mean@n, std@n, response_tokens) it is analytic, the standard deviation of the per-task values
over ``√tasks``; for pass@k and maj@n it is the standard deviation of the figure over
:data:`BOOTSTRAP` resamples of the tasks with replacement, drawn with ``eval.seed`` (0 with
fewer than two tasks).

Every sample is kept in :attr:`~orchestrator.types.Evaluation.samples` (reply, answer, vote,
reward, task id), for the run directory's ``eval_samples.jsonl`` and the command's per-evaluation
file.

A task's data source is its ``metadata["data_source"]`` (``env=dataset`` rows), else the
environment's name. Every task's samples run at once (the engine batches them). Where a
periodic evaluation during RL runs, and so whether it sees one policy version, is
``eval.engine`` (:func:`orchestrator.run.loop._periodic`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio
import numpy as np

from envs.base import Task
from envs.votes import Votes, votes_of
from orchestrator.config.schema import EvalConfig
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.gateway import agent_gateway, evaluate_agents
from orchestrator.types import EvalSample, Evaluation, Scores

EXAMPLES_PER_SOURCE = 4  # samples per data source shown as examples (W&B's table)
BOOTSTRAP = 1000  # resamples of the tasks for pass@k's and maj@n's standard errors


async def evaluate(runner: EpisodeRunner, tasks: Sequence[Task],
                   config: EvalConfig | None = None,
                   on_sample: Callable[[EvalSample], None] | None = None) -> Evaluation:
    """``config.n`` episodes of each task sampled as ``config`` says (temperature, top-p,
    top-k, max tokens; None: the defaults, one greedy sample), scored, every task's samples
    grouped by answer for maj@n; ``on_sample`` sees each sample as it finishes (a progress
    bar)."""
    config = config if config is not None else EvalConfig()
    runner.spec.use_clock(runner.recorder.clock)  # tools report times on the recorder's clock
    sampler = runner.for_eval(config)
    if runner.spec.runs_programs:
        async with agent_gateway(sampler) as gateway:
            assert gateway is not None
            samples = await evaluate_agents(gateway, sampler, tasks, config.n)
        for sample in samples if on_sample is not None else ():
            on_sample(sample)
    else:
        samples = []

        async def one(task: Task, index: int) -> None:
            trajectory, _ = await sampler.episode(task, "eval", sample_index=index)
            samples.append(sampler.eval_sample(task, index, [trajectory], trajectory.reward))
            if on_sample is not None:
                on_sample(samples[-1])

        async with anyio.create_task_group() as tg:
            for task in tasks:
                for index in range(config.n):
                    tg.start_soon(one, task, index)
    async with votes_of(runner.spec) as votes:
        samples = await voted(samples, tasks, votes, config.success_threshold)
    return score(samples, config)


async def voted(samples: Sequence[EvalSample], tasks: Sequence[Task], votes: Votes,
                threshold: float) -> list[EvalSample]:
    """``samples`` with their answers read and their maj@n groups (``vote``) set by
    ``votes``, task by task, each by its data source's route (a task's metadata reaches a
    user's reward)."""
    metadata = {task.id: task.metadata for task in tasks}
    by_task: dict[int, list[EvalSample]] = defaultdict(list)
    for sample in samples:
        by_task[sample.task_id].append(sample)
    out: list[EvalSample] = []
    for task_id, task_samples in by_task.items():
        task_samples.sort(key=lambda s: s.sample_index)
        # an episode with no reply (an agent program that never called the model) gives none
        replies = [s.reply if s.reply else "" for s in task_samples]
        route = votes.for_source(task_samples[0].source)
        groups = await route.groups(replies, metadata.get(task_id, {}), threshold)
        for sample, reply, group in zip(task_samples, replies, groups, strict=True):
            answer = route.answer(reply) if group is not None else None
            vote = None if group is None else task_samples[group].sample_index
            out.append(replace(sample, answer=answer, vote=vote))
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``c`` correct samples of ``n``: the chance that ``k``
    of them drawn without replacement include a correct one, ``1 − C(n−c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(samples: Sequence[EvalSample]) -> float | None:
    """A task's maj@n: the mean reward of the samples of its largest answer group (``vote``;
    ties: the group whose first sample came first); 0 when none gave an answer, None for no
    samples."""
    if not samples:
        return None
    ordered = sorted(samples, key=lambda s: s.sample_index)
    votes = [s.vote for s in ordered if s.vote is not None]
    if not votes:
        return 0.0
    winner = Counter(votes).most_common(1)[0][0]  # equal counts keep first-seen order
    rewards = [s.reward for s in ordered if s.vote == winner]
    return sum(rewards) / len(rewards)


def analytic_se(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (0 for fewer than two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def bootstrap_se(values: Sequence[float], seed: int, resamples: int = BOOTSTRAP) -> float:
    """The standard error of the mean of per-task ``values`` by the bootstrap over tasks: the
    standard deviation of the mean of ``resamples`` draws of as many tasks with replacement
    (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    # Vectorised: a warm start evaluates every few steps, and 1,000 resamples of 200 tasks
    # drawn one Python call at a time cost about 0.1 s each (3 s of a short run's start).
    draws = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    return float(np.asarray(values, dtype=np.float64)[draws].mean(axis=1).std(ddof=1))


def scores(tasks: Sequence[Sequence[EvalSample]], ks: Sequence[int], threshold: float,
           seed: int = 0) -> Scores:
    """The figures of ``tasks``, each given as its samples, with their standard errors."""
    tasks = [t for t in tasks if t]
    rewards = [s.reward for t in tasks for s in t]
    count = max(len(tasks), 1)
    means = [statistics.fmean(s.reward for s in t) for t in tasks]
    spreads = [statistics.pstdev([s.reward for s in t]) for t in tasks]
    lengths = [statistics.fmean(s.tokens for s in t) for t in tasks]
    pass_at, se = {}, {}
    for k in ks:
        per_task = [pass_at_k(len(t), sum(s.reward >= threshold for s in t), k)
                    if len(t) >= k else 0.0 for t in tasks]
        pass_at[k] = sum(per_task) / count
        se[f"pass@{k}"] = bootstrap_se(per_task, seed)
    voting = any(s.vote is not None for t in tasks for s in t)
    maj = None
    if voting:
        per_task = [majority(t) or 0.0 for t in tasks]
        maj = sum(per_task) / count
        se["maj"] = bootstrap_se(per_task, seed)
    se.update(mean=analytic_se(means), std=analytic_se(spreads),
              response_tokens=analytic_se(lengths))
    return Scores(
        tasks=len(tasks), samples=len(rewards),
        mean=sum(rewards) / max(len(rewards), 1),
        std=sum(spreads) / count,
        pass_at=pass_at, maj=maj,
        response_tokens=sum(s.tokens for t in tasks for s in t) / max(len(rewards), 1),
        se=se)


def score(samples: Sequence[EvalSample], config: EvalConfig,
          examples: int = EXAMPLES_PER_SOURCE) -> Evaluation:
    """An :class:`Evaluation` of ``samples``: per data source and over all tasks, every
    sample kept, the first sample of the first ``examples`` tasks of each source as its
    examples."""
    by_task: dict[tuple[str, int], list[EvalSample]] = defaultdict(list)
    for sample in samples:
        by_task[(sample.source, sample.task_id)].append(sample)
    by_source: dict[str, list[list[EvalSample]]] = defaultdict(list)
    for (source, _), task_samples in sorted(by_task.items()):
        task_samples.sort(key=lambda s: s.sample_index)
        by_source[source].append(task_samples)
    ks, threshold, seed = config.ks, config.success_threshold, config.seed
    return Evaluation(
        n=config.n, temperature=config.temperature, success_threshold=threshold,
        overall=scores([by_task[key] for key in sorted(by_task)], ks, threshold, seed),
        sources={source: scores(tasks, ks, threshold, seed)
                 for source, tasks in by_source.items()},
        examples=tuple(t[0] for tasks in by_source.values() for t in tasks[:examples]),
        samples=tuple(s for key in sorted(by_task) for s in by_task[key]))
