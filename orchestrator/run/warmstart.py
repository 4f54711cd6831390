"""Supervised warm start: a few cross-entropy steps on reference answers before RL.

A randomly initialised policy never samples a correct answer, so RL has no signal. A short
warm start teaches the chat format and a rough skill; RL takes it from there. What it learns
from is each task's reference episode (``EnvSpec.demonstration``): the opening messages as
the prompt, then every assistant turn as a target and every other message (a tool result)
as context, tokenised the way the episode runner appends them.

Where it stops: after ``steps`` steps, or earlier, with ``target_accuracy`` set, as soon as a
greedy check (every ``check_every`` steps) reaches that accuracy. Supervised learning of a
small model is steep — a few dozen steps can move accuracy from 0.1 to 0.6 — so a target
gives RL the same starting point on every machine and seed, where a fixed step count would
not (thread counts alone change the numerics enough to matter).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence

from envs.base import Message, Task
from orchestrator.config.schema import WarmStartConfig
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trainer import Trainer


def reference_answer(task: Task) -> tuple[Message, ...]:
    return (*task.messages, {"role": "assistant", "content": task.answer})


def demonstration_tokens(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
    """Token ids of a reference episode and the mask of its assistant turns (the targets)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant message")
    ids = tokenizer.chat_prompt(messages[:first])
    mask = [False] * len(ids)
    context: list[Message] = []
    for message in messages[first:]:
        if message["role"] != "assistant":
            context.append(message)
            continue
        if context:  # tool results between two assistant turns, as the runner appends them
            observation = tokenizer.chat_prompt(context, continuation=True)
            ids += observation
            mask += [False] * len(observation)
            context = []
        reply = tokenizer.completion(message["content"])
        ids += reply
        mask += [True] * len(reply)
    return ids, mask


async def warm_start(
    trainer: Trainer,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    config: WarmStartConfig,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    accuracy: Callable[[], Awaitable[float]] | None = None,
    demonstrate: Callable[[Task], Sequence[Message]] = reference_answer,
) -> list[float]:
    """Run the warm start through ``trainer.supervised_step`` (any :class:`Trainer`, in this
    process or not); ``await accuracy()`` is the greedy check used with ``target_accuracy``,
    ``demonstrate(task)`` the reference episode learned from."""
    if config.steps <= 0:
        return []
    rng = random.Random(seed)
    cache: dict[int, tuple[list[int], list[bool]]] = {}
    losses = []
    for step in range(config.steps):
        sequences, masks = [], []
        # by index: a dataset's tasks are built one at a time (same draws as sampling the list)
        drawn = rng.sample(range(len(tasks)), min(config.batch_size, len(tasks)))
        for task in (tasks[i] for i in drawn):
            if task.id not in cache:
                cache[task.id] = demonstration_tokens(tokenizer, demonstrate(task))
            ids, mask = cache[task.id]
            sequences.append(ids)
            masks.append(mask)
        loss = await trainer.supervised_step(sequences, masks, config.lr)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
        checkpoint = (step + 1) % max(config.check_every, 1) == 0
        if config.target_accuracy is not None and accuracy is not None and checkpoint:
            if await accuracy() >= config.target_accuracy:
                break
    return losses
