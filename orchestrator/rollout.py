"""The episode runner: drives an ``Env`` with an engine, token in and token out.

The episode's token sequence is built only by appending: the prompt's tokens, then exactly
the tokens the engine sampled (trained on, with their behaviour log-probs and versions),
then the tokens of each observation (not trained on). Nothing earlier is re-tokenised, so
what the trainer scores is exactly what the engine saw and produced.

Caps end an episode with a recorded ``end_reason``: ``done`` (the environment finished it),
``max_turns``, ``max_length`` (``max_total_tokens`` reached: each turn's generation is also
limited to what is left) or ``tool_response_too_long`` (an observation longer than
``max_tool_response_tokens``; it is not appended). Per-turn metrics are summed.

A group is ``group_size`` episodes of one task run concurrently (the engine batches them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import anyio

from envs.base import EnvSpec, Message, Task, ToolCallRecord
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.recorder import Recorder
from orchestrator.types import (
    FinishReason,
    Group,
    SamplingParams,
    ToolTiming,
    Trajectory,
    TurnTiming,
)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    max_turns: int = 1
    max_total_tokens: int | None = None  # prompt + every turn; None: the engine's context
    max_tool_response_tokens: int | None = None

    def validate(self) -> None:
        for key in ("group_size", "max_tokens", "max_turns"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {self.temperature}")
        for key in ("max_total_tokens", "max_tool_response_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"rollout.{key} must be >= 1 or null, got {value}")


async def run_episode(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    spec: EnvSpec,
    task: Task,
    config: RolloutConfig,
    recorder: Recorder,
    worker: str,
    sample_index: int = 0,
) -> Trajectory:
    sampling = SamplingParams(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        stop_token_ids=tokenizer.stop_ids,
    )
    started_at = recorder.now()
    turns: list[TurnTiming] = []
    tool_timings: list[ToolTiming] = []
    async with spec.make_env() as env:
        messages = await env.reset(task)
        ids = tokenizer.chat_prompt(messages)
        prompt_tokens = len(ids)
        mask = [False] * len(ids)
        logprobs = [0.0] * len(ids)
        versions = [-1] * len(ids)
        step_reward = 0.0
        start_version: int | None = None
        finish = FinishReason.LENGTH
        metrics: dict[str, float] = {}
        end_reason = "max_turns"
        limit = config.max_total_tokens
        for turn in range(config.max_turns):
            if limit is not None and len(ids) >= limit:
                end_reason = "max_length"
                break
            turn_sampling = sampling if limit is None else replace(
                sampling, max_tokens=min(sampling.max_tokens, limit - len(ids)))
            metrics["episode/turns"] = turn + 1.0
            turn_start = recorder.now()
            turn_prompt = len(ids)
            with recorder.span("generate", worker, engine.version, turn=turn,
                               prompt_tokens=len(ids), sample=sample_index) as attrs:
                gen = await engine.generate(ids, turn_sampling)
                attrs.update(completion_tokens=len(gen.token_ids), finish_reason=str(gen.finish_reason))
            turn_latency = recorder.now() - turn_start
            if start_version is None:
                start_version = gen.versions[0] if gen.versions else gen.start_version
            ids += gen.token_ids
            mask += [True] * len(gen.token_ids)
            logprobs += gen.logprobs
            versions += gen.versions
            finish = gen.finish_reason
            reply_ids = [t for t in gen.token_ids if t not in tokenizer.stop_ids]
            result = await env.step(tokenizer.decode(reply_ids))
            for call in result.tool_calls:  # one span per tool call, with its latency and status
                start = recorder.at(call.started)
                recorder.add("tool_call", worker, start, start + call.latency, engine.version,
                             tool=call.name, status=call.status, error_kind=call.error_kind,
                             turn=turn, sample=sample_index)
            turns.append(TurnTiming(
                turn=turn, start=turn_start, latency=turn_latency, prompt_tokens=turn_prompt,
                cached_tokens=gen.cached_tokens, completion_tokens=len(gen.token_ids),
                max_new_tokens=turn_sampling.max_tokens, text_tokens=len(reply_ids),
                finish_reason=_trace_finish(gen.finish_reason, result.done, len(result.tool_calls)),
                tool_call_count=len(result.tool_calls), version=gen.start_version,
            ))
            step_reward += result.reward
            for key, value in result.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
            if result.done:
                end_reason = "done"
                break
            observation = tokenizer.chat_prompt(result.observation, continuation=True)
            cap = config.max_tool_response_tokens
            if cap is not None and len(observation) > cap:
                end_reason = "tool_response_too_long"
                break
            if limit is not None and len(ids) + len(observation) >= limit:
                end_reason = "max_length"
                break
            turns[-1] = replace(turns[-1], observation_tokens=len(observation))
            tool_timings += _tool_timings(tokenizer, turn, result.tool_calls, result.observation,
                                          len(observation), recorder)
            ids += observation
            mask += [False] * len(observation)
            logprobs += [0.0] * len(observation)
            versions += [-1] * len(observation)
        reward_start = recorder.now()
        with recorder.span("reward", worker, engine.version, sample=sample_index) as attrs:
            reward = await env.reward()
            attrs["reward"] = reward.total
        reward_seconds = recorder.now() - reward_start
    metrics.update({f"reward/{k}": v for k, v in reward.components.items()})
    return Trajectory(
        prompt_id=task.id,
        sample_index=sample_index,
        token_ids=tuple(ids),
        loss_mask=tuple(mask),
        logprobs=tuple(logprobs),
        versions=tuple(versions),
        reward=step_reward + reward.total,
        start_version=start_version if start_version is not None else engine.version,
        finish_reason=finish,
        metrics=metrics,
        end_reason=end_reason,
        turns=tuple(turns),
        tool_calls=tuple(tool_timings),
        prompt_tokens=prompt_tokens,
        max_tokens=config.max_tokens,
        started_at=started_at,
        finished_at=recorder.now(),
        reward_seconds=reward_seconds,
        worker=worker,
    )


def _trace_finish(finish: FinishReason, done: bool, tool_calls: int) -> str:
    """The PolyTrace name of why a turn ended."""
    if finish is FinishReason.LENGTH:
        return "length"
    if not done and tool_calls:
        return "tool_calls"
    return "stop" if finish is FinishReason.STOP else str(finish)


def _tool_timings(tokenizer: Tokenizer, turn: int, calls: Sequence[ToolCallRecord],
                  observation: Sequence[Message], appended: int,
                  recorder: Recorder) -> list[ToolTiming]:
    """One record per tool call; the turn's observation tokens are split over its calls by
    their messages' lengths (the last takes the chat template's tokens)."""
    sizes = [len(tokenizer.encode(m.get("content", ""))) for m in observation]
    if len(sizes) != len(calls):  # an environment whose observation is not one message per call
        sizes = [0] * len(calls)
    timings = []
    for i, call in enumerate(calls):
        metadata = getattr(call, "metadata", None) or {}
        query_count = metadata.get("query_count", 1)
        timings.append(ToolTiming(
            turn=turn, name=call.name, status=call.status, start=recorder.at(call.started),
            latency=call.latency, error_kind=call.error_kind,
            query_count=query_count if isinstance(query_count, int) else 1,
            response_tokens=sizes[i],
            append_tokens=sizes[i] if i < len(calls) - 1 else appended - sum(sizes[:-1]),
        ))
    return timings


async def run_group(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    spec: EnvSpec,
    task: Task,
    config: RolloutConfig,
    recorder: Recorder,
    worker: str,
) -> Group:
    started = recorder.now()
    results: list[Trajectory | None] = [None] * config.group_size

    async def one(index: int) -> None:
        results[index] = await run_episode(
            engine, tokenizer, spec, task, config, recorder, worker, sample_index=index
        )

    async with anyio.create_task_group() as tg:
        for i in range(config.group_size):
            tg.start_soon(one, i)
    trajectories = tuple(t for t in results if t is not None)
    return Group(
        prompt_id=task.id,
        trajectories=trajectories,
        start_version=min(t.start_version for t in trajectories),
        started_at=started,
        finished_at=recorder.now(),
    )
