"""Reward functions the tests name as ``dataset_reward_fns:<name>`` (imported by the reward
worker processes too: this directory is on the tests' path)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from envs.base import Reward


def length_bonus(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if metadata.get("difficulty") == "easy" and answer in completion else 0.0


async def async_named(completion: str, answer: str, metadata: Mapping[str, Any]) -> Reward:
    return Reward(total=0.5, components={"half": 0.5})


def picky(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """Hangs on "hang", kills its own process on "crash", raises on "raise"; else 1."""
    if "hang" in completion:
        time.sleep(3600)
    if "crash" in completion:
        os._exit(3)
    if "raise" in completion:
        raise ValueError("cannot verify this")
    return 1.0


def wrong_signature(completion: str) -> float:
    return 0.0


not_a_function = 3


def sees_everything(completion: str, answer: str, metadata: Mapping[str, Any], *,
                    prompt: list[dict[str, str]], data_source: str,
                    transcript: list[dict[str, str]]) -> Reward:
    """Ours, with every keyword: 1 when the reply is the answer; what it saw, as diagnostics."""
    return Reward(float(completion.strip() == answer), {
        "prompt_messages": float(len(prompt)), "transcript_messages": float(len(transcript)),
        "source_is_gsm8k": float(data_source == "gsm8k"),
        "has_level": float("level" in metadata)})


def trl_style(prompts: list[Any], completions: list[Any], answer: list[str],
              level: list[int], **kwargs: Any) -> list[float]:
    """TRL's convention: batched lists in, a list out (conversational or plain)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(t.strip() == a) + 0.1 * lv for t, a, lv in zip(texts, answer, level, strict=True)]


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, float]:
    """verl's convention: a dict with its score and other numbers."""
    right = float(solution_str.strip() == ground_truth)
    return {"score": right, "acc": right, "split_is_train": float(
        (extra_info or {}).get("split") == "train"), "source_ok": float(data_source == "gsm8k")}


def returns_nan(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return float("nan")


def returns_text(completion: str, answer: str, metadata: Mapping[str, Any]) -> str:
    return "1.0"


def always_raises(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    raise RuntimeError("the verifier's service is down")


async def slow_async(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """Sleeps ``sleep_s``; with ``log`` (a path), appends its ``start end`` (the host's
    monotonic clock, one for every process) there."""
    import asyncio
    import time

    started = time.monotonic()
    await asyncio.sleep(float(metadata.get("sleep_s", 0.5)))
    if "log" in metadata:
        with open(metadata["log"], "a") as f:  # noqa: ASYNC230 - one short line, once
            f.write(f"{started} {time.monotonic()}\n")
    return 1.0


def fits_nothing(reply: str, *, gold: str) -> float:
    return 0.0


def length_share(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """A user's reward for any environment: the reply's length over 100, at most 1."""
    return min(1.0, len(completion) / 100)


def trl_batch_size(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL's convention, scoring each completion with the size of the batch it came in: how
    many samples shared the call."""
    return [float(len(completions))] * len(completions)


def trl_raises(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    raise ValueError("no scores today")


def trl_one_short(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) - 1)


def trl_odd_is_text(prompts: list[Any], completions: list[Any], index: list[int],
                    **kwargs: Any) -> list[Any]:
    """A number for each even ``index`` column, text (not a score) for each odd one."""
    return [1.0 if i % 2 == 0 else "one" for i in index]
