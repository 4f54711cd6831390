"""The episode runner: drives an ``Env`` with an engine, token in and token out.

:class:`EpisodeRunner` holds what every episode of a run shares (the engine, tokenizer,
environment spec, rollout settings and recorder); the pipeline's rollout workers, the
evaluations and the warm start's checks each run their episodes through one.

An episode reads top to bottom: reset; per turn, generate, step the environment, check the
caps, append the observation; then the reward, and the trajectory (what the trainer gets)
and its timing (what the trace writers get), each built once. Two helpers own the rest:

* :class:`~orchestrator.episodes.trajectory.TrajectoryBuilder` holds the token sequence, built only
  by appending: the prompt, exactly the tokens the engine sampled (trained on, with their behaviour
  log-probs and versions), the tokens of each observation (not trained on). Nothing earlier is
  re-tokenised, so what the trainer scores is what the engine saw and produced.
* :class:`~orchestrator.trace.episode.EpisodeTrace` records the spans (``generate``,
  ``tool_call``, ``reward``) and the turn and tool-call timings. The runner reads nothing of
  what tools report: their metadata passes through to the trace writers.

Caps end an episode with a recorded ``end_reason``: ``done`` (the environment finished it),
``max_turns``, ``max_length`` (``max_total_tokens`` reached: each turn's generation is also
limited to what is left) or ``tool_response_too_long`` (an observation longer than
``max_tool_response_tokens``; it is not appended). Per-turn metrics are summed.

A group is ``group_size`` episodes of one task run concurrently (the engine batches them),
its trajectories in episode order whatever order they finish in. Given a seed
(:func:`sample_seed`), each episode's every turn samples with a seed of its own, derived
from it, its episode's index and the turn, so what a sample draws does not depend on what
else the engine was running.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import anyio

from envs.base import EnvSpec, Task
from orchestrator.config.schema import EvalConfig, RolloutConfig
from orchestrator.engines.base import InferenceEngine
from orchestrator.episodes.trajectory import TrajectoryBuilder
from orchestrator.errors import ConfigError
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trace.episode import EpisodeTrace
from orchestrator.trace.recorder import Recorder
from orchestrator.types import (
    EpisodeTiming,
    EvalSample,
    Group,
    GroupTiming,
    SamplingParams,
    TimedGroup,
    Trajectory,
)


@dataclass(frozen=True)
class EpisodeRunner:
    """Runs episodes and groups of episodes of one environment on one engine."""

    engine: InferenceEngine
    tokenizer: Tokenizer
    spec: EnvSpec
    config: RolloutConfig
    recorder: Recorder

    def greedy(self) -> EpisodeRunner:
        """This runner at temperature 0 (evaluations)."""
        return self.at_temperature(0.0)

    def at_temperature(self, temperature: float) -> EpisodeRunner:
        """This runner sampling at ``temperature`` (an evaluation's ``eval.temperature``)."""
        return replace(self, config=replace(self.config, temperature=temperature))

    def for_eval(self, config: EvalConfig) -> EpisodeRunner:
        """This runner sampling as an evaluation does: ``eval.temperature``, ``eval.top_p``,
        ``eval.top_k`` and ``eval.max_tokens`` (null: the rollout's)."""
        return replace(self, config=replace(
            self.config, temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, max_tokens=config.max_tokens or self.config.max_tokens))

    def eval_sample(self, task: Task, index: int, trajectories: Sequence[Trajectory],
                    reward: float) -> EvalSample:
        """Sample ``index`` of ``task`` in an evaluation, from its episode's trajectories (one;
        an agent episode's segments, the answer read from the last), as text: the prompt, the
        completion (everything after the prompt), the final reply's answer
        (:meth:`~envs.base.EnvSpec.extract_answer`)."""
        tokenizer, first, last = self.tokenizer, trajectories[0], trajectories[-1]
        stops = tokenizer.stop_ids
        ids = last.token_ids
        end = len(last.loss_mask)  # the final reply: the last run of generated tokens
        while end > 0 and not last.loss_mask[end - 1]:
            end -= 1
        start = end
        while start > 0 and last.loss_mask[start - 1]:
            start -= 1
        reply = tokenizer.decode(_without(ids[start:end], stops))
        return EvalSample(
            task_id=task.id, sample_index=index, source=data_source(task, self.spec),
            reward=reward, tokens=sum(t.num_generated for t in trajectories),
            answer=self.spec.extract_answer(reply),
            prompt=tokenizer.decode(list(first.token_ids[:first.prompt_tokens])),
            completion=tokenizer.decode(_without(ids[last.prompt_tokens:], stops)),
            reference=task.answer, reply=reply, origin=task.origin)

    async def episode(self, task: Task, worker: str, sample_index: int = 0,
                      generated: Callable[[int], None] | None = None,
                      seed: int | None = None) -> tuple[Trajectory, EpisodeTiming]:
        """One episode of ``task``; ``generated`` is called with its start version once its
        last generation has ended, before its reward; ``seed``: the episode's, each turn
        sampling with ``sample_seed(seed, turn)`` (None: the engine's own randomness)."""
        engine, tokenizer, config = self.engine, self.tokenizer, self.config
        trace = EpisodeTrace(self.recorder, worker, sample_index, tokenizer)
        tokens = TrajectoryBuilder()
        metrics: dict[str, float] = {}
        step_reward, end_reason = 0.0, "max_turns"
        async with self.spec.make_env() as env:
            tokens.add_prompt(tokenizer.chat_prompt(await env.reset(task)))
            _check_context(engine, self.spec, len(tokens))
            for turn in range(config.max_turns):
                sampling = _turn_sampling(config, tokenizer, len(tokens),
                                          None if seed is None else sample_seed(seed, turn))
                if sampling is None:
                    end_reason = "max_length"
                    break
                metrics["episode/turns"] = turn + 1.0
                gen = await trace.generate(turn, engine.version, len(tokens),
                                           engine.generate(tokens.ids, sampling))
                tokens.add_generation(gen)
                reply = _without(gen.token_ids, tokenizer.stop_ids)
                result = await env.step(tokenizer.decode(reply))
                step_reward += result.reward
                for key, value in result.metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + value
                observation = [] if result.done else tokenizer.chat_prompt(result.observation,
                                                                           continuation=True)
                ended = _end_reason(config, result.done, len(tokens), len(observation))
                trace.turn(gen, result, sampling.max_tokens, len(reply),
                           appended=None if ended else len(observation))
                if ended:
                    end_reason = ended
                    break
                tokens.add_observation(observation)
            if generated is not None:
                generated(engine.version if tokens.start_version is None else tokens.start_version)
            reward = await trace.reward(engine.version, env.reward())
        metrics.update({f"reward/{k}": v for k, v in reward.components.items()})
        trajectory = tokens.build(
            prompt_id=task.id, sample_index=sample_index, reward=step_reward + reward.total,
            version=engine.version, end_reason=end_reason, max_tokens=config.max_tokens,
            metrics=metrics, reward_terms=reward.terms,
        )
        return trajectory, trace.finish()

    async def group(self, task: Task, worker: str, queue_wait: float = 0.0,
                    generated: Callable[[int], None] | None = None,
                    seed: int | None = None) -> TimedGroup:
        """``group_size`` episodes of ``task``, run concurrently; ``queue_wait``: the seconds
        the group waited for admission; ``generated`` is called with the group's start version
        once every episode's generation has ended (the rest is scoring); ``seed``: the
        group's, episode ``i`` sampling with ``sample_seed(seed, i)``'s (None: unseeded)."""
        versions: list[int] = []

        def one_generated(version: int) -> None:
            versions.append(version)
            if generated is not None and len(versions) == self.config.group_size:
                generated(min(versions))

        async def one(index: int) -> list[tuple[Trajectory, EpisodeTiming]]:
            return [await self.episode(task, worker, sample_index=index, generated=one_generated,
                                       seed=None if seed is None else sample_seed(seed, index))]

        return await fan_out(self, task, one, queue_wait)


async def fan_out(runner: EpisodeRunner, task: Task,
                  one: Callable[[int], Awaitable[Sequence[tuple[Trajectory, EpisodeTiming]]]],
                  queue_wait: float = 0.0) -> TimedGroup:
    """A group of ``task``: its ``group_size`` episodes run concurrently, ``one(i)`` giving
    episode ``i``'s samples (one; an agent episode's segments), gathered in episode order (not
    the order they finished in, which depends on timing: a group's order is part of what the
    trainer computes, float sums included); ``queue_wait``: the seconds the group waited for
    admission. A group of no samples (agent programs that never called the model) starts at
    the engine's version."""
    recorder = runner.recorder
    started, version = recorder.now(), runner.engine.version
    episodes: list[Sequence[tuple[Trajectory, EpisodeTiming]]] = [()] * runner.config.group_size

    async def run(index: int) -> None:
        episodes[index] = await one(index)

    async with anyio.create_task_group() as tg:
        for i in range(runner.config.group_size):
            tg.start_soon(run, i)
    done = [sample for samples in episodes for sample in samples]
    trajectories = tuple(t for t, _ in done)
    return TimedGroup(
        Group(prompt_id=task.id, trajectories=trajectories,
              start_version=min((t.start_version for t in trajectories), default=version)),
        GroupTiming(started_at=started, finished_at=recorder.now(),
                    episodes=tuple(timing for _, timing in done), queue_wait=queue_wait),
    )


def sample_seed(*keys: int) -> int:
    """A sampling seed (63 bits) derived from ``keys``, the same in every process: the
    pipeline's group of the sampler's ``n``-th task is seeded ``sample_seed(seed, n)``, its
    episode ``i`` ``sample_seed(that, i)``, the episode's turn ``t`` ``sample_seed(that, t)``."""
    digest = hashlib.blake2b(b"".join(k.to_bytes(16, "little", signed=True) for k in keys),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def data_source(task: Task, spec: EnvSpec) -> str:
    """Where ``task`` comes from, for per-source figures: its ``metadata["data_source"]``
    (``env=dataset`` rows have one), else the environment's name."""
    source = task.metadata.get("data_source")
    return str(source) if source else str(getattr(spec, "name", type(spec).__name__))


def _check_context(engine: InferenceEngine, spec: EnvSpec, prompt: int) -> None:
    """An opening prompt the model cannot even read is a setting to change, not a sample."""
    limit = engine.context_length
    if limit is not None and prompt >= limit:
        raise ConfigError(
            f"an opening prompt of env={getattr(spec, 'name', type(spec).__name__)} is {prompt} "
            f"tokens and the model's context is {limit}: use a model with a longer context "
            "(model.max_position_embeddings for model=tiny) or shorter prompts")


def _without(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``ids`` less its stop tokens (a stop ends a generation, so the common case is one at
    the end: found and dropped at C speed, which matters for replies of thousands of tokens)."""
    reply = list(ids)
    while reply and reply[-1] in stop_ids:
        reply.pop()
    if any(s in reply for s in stop_ids):
        stop = frozenset(stop_ids)
        reply = [t for t in reply if t not in stop]
    return reply


def _turn_sampling(config: RolloutConfig, tokenizer: Tokenizer, length: int,
                   seed: int | None = None) -> SamplingParams | None:
    """A turn's sampling after ``length`` tokens, with ``seed``: no more than
    ``max_total_tokens`` leaves (None: nothing is left)."""
    max_tokens = config.max_tokens
    if config.max_total_tokens is not None:
        if length >= config.max_total_tokens:
            return None
        max_tokens = min(max_tokens, config.max_total_tokens - length)
    return SamplingParams(max_tokens=max_tokens, temperature=config.temperature,
                          stop_token_ids=tokenizer.stop_ids, seed=seed, top_p=config.top_p,
                          top_k=config.top_k)


def _end_reason(config: RolloutConfig, done: bool, length: int, observation: int) -> str | None:
    """Why the episode ends after a step, or None to append its ``observation`` tokens."""
    if done:
        return "done"
    cap = config.max_tool_response_tokens
    if cap is not None and observation > cap:
        return "tool_response_too_long"
    limit = config.max_total_tokens
    if limit is not None and length + observation >= limit:
        return "max_length"
    return None
