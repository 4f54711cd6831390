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
* **maj@n** — the majority vote: each task's most common answer among its samples (the
  environment's :meth:`~envs.base.EnvSpec.extract_answer` of the final reply; ties go to the
  answer given first) scores the mean reward of the samples that gave it, 0 when no sample gave
  an answer; averaged over the tasks. Not reported where no sample gave an answer (``code``,
  whose replies are programs);
* **response_tokens** — the mean number of generated tokens per sample.

A task's data source is its ``metadata["data_source"]`` (``env=dataset`` rows), else the
environment's name. Every task's samples run at once (the engine batches them). Where a
periodic evaluation during RL runs, and so whether it sees one policy version, is
``eval.engine`` (:func:`orchestrator.runloop._periodic`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import anyio

from envs.agent import AgentSpec
from envs.base import Task
from orchestrator.gateway import agent_gateway, evaluate_agents
from orchestrator.rollout import EpisodeRunner
from orchestrator.schema import EvalConfig
from orchestrator.types import EvalSample, Evaluation, Scores

EXAMPLES_PER_SOURCE = 4  # samples per data source kept for eval_samples.jsonl and W&B


def _shown(k: object) -> str:
    return str(list(k)) if isinstance(k, Sequence) and not isinstance(k, str) else str(k)


async def evaluate(runner: EpisodeRunner, tasks: Sequence[Task],
                   config: EvalConfig = EvalConfig(),
                   on_sample: Callable[[EvalSample], None] | None = None) -> Evaluation:
    """``config.n`` episodes of each task at ``config.temperature``, scored; ``on_sample``
    sees each sample as it finishes (a progress bar)."""
    runner.spec.use_clock(runner.recorder.clock)  # tools report times on the recorder's clock
    sampler = runner.at_temperature(config.temperature)
    if isinstance(runner.spec, AgentSpec):
        async with agent_gateway(sampler) as gateway:
            assert gateway is not None
            samples = await evaluate_agents(gateway, sampler, tasks, config.n)
        for sample in samples if on_sample is not None else ():
            on_sample(sample)
        return score(samples, config)
    samples: list[EvalSample] = []

    async def one(task: Task, index: int) -> None:
        trajectory, _ = await sampler.episode(task, "eval", sample_index=index)
        samples.append(sampler.eval_sample(task, index, [trajectory], trajectory.reward))
        if on_sample is not None:
            on_sample(samples[-1])

    async with anyio.create_task_group() as tg:
        for task in tasks:
            for index in range(config.n):
                tg.start_soon(one, task, index)
    return score(samples, config)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``c`` correct samples of ``n``: the chance that ``k``
    of them drawn without replacement include a correct one, ``1 − C(n−c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(samples: Sequence[EvalSample]) -> float | None:
    """A task's maj@n: the mean reward of the samples that gave its most common answer (ties:
    the one given first, by sample index); 0 when none gave an answer, None for no samples."""
    if not samples:
        return None
    ordered = sorted(samples, key=lambda s: s.sample_index)
    answers = [s.answer for s in ordered if s.answer is not None]
    if not answers:
        return 0.0
    voted = Counter(answers).most_common(1)[0][0]  # equal counts keep first-seen order
    rewards = [s.reward for s in ordered if s.answer == voted]
    return sum(rewards) / len(rewards)


def scores(tasks: Sequence[Sequence[EvalSample]], ks: Sequence[int], threshold: float) -> Scores:
    """The figures of ``tasks``, each given as its samples."""
    tasks = [t for t in tasks if t]
    rewards = [s.reward for t in tasks for s in t]
    count = max(len(tasks), 1)
    pass_at = {}
    for k in ks:
        pass_at[k] = sum(pass_at_k(len(t), sum(s.reward >= threshold for s in t), k)
                         for t in tasks if len(t) >= k) / count
    voting = any(s.answer is not None for t in tasks for s in t)
    maj = sum(majority(t) or 0.0 for t in tasks) / count if voting else None
    return Scores(
        tasks=len(tasks), samples=len(rewards),
        mean=sum(rewards) / max(len(rewards), 1),
        std=sum(statistics.pstdev([s.reward for s in t]) for t in tasks) / count,
        pass_at=pass_at, maj=maj,
        response_tokens=sum(s.tokens for t in tasks for s in t) / max(len(rewards), 1))


def score(samples: Sequence[EvalSample], config: EvalConfig,
          examples: int = EXAMPLES_PER_SOURCE) -> Evaluation:
    """An :class:`Evaluation` of ``samples``: per data source and over all tasks, with the
    first sample of the first ``examples`` tasks of each source as its examples."""
    by_task: dict[tuple[str, int], list[EvalSample]] = defaultdict(list)
    for sample in samples:
        by_task[(sample.source, sample.task_id)].append(sample)
    by_source: dict[str, list[list[EvalSample]]] = defaultdict(list)
    for (source, _), task_samples in sorted(by_task.items()):
        task_samples.sort(key=lambda s: s.sample_index)
        by_source[source].append(task_samples)
    return Evaluation(
        n=config.n, temperature=config.temperature, success_threshold=config.success_threshold,
        overall=scores(list(by_task.values()), config.ks, config.success_threshold),
        sources={source: scores(tasks, config.ks, config.success_threshold)
                 for source, tasks in by_source.items()},
        examples=tuple(t[0] for tasks in by_source.values() for t in tasks[:examples]))
