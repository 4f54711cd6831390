"""Supervised warm start: a few cross-entropy steps on reference answers before RL.

A randomly initialised policy never samples a correct answer, so RL has no signal. A short
warm start teaches the chat format and a rough skill; RL takes it from there. The step count
is kept deliberately small so that most of what the run shows is RL's doing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from envs.base import Task
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trainer import Trainer


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 100
    batch_size: int = 64
    lr: float = 1e-3


def warm_start(
    trainer: Trainer,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    config: WarmStartConfig,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    if config.steps <= 0:
        return []
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=config.lr, weight_decay=0.0)
    losses = []
    for step in range(config.steps):
        sequences, masks = [], []
        for task in rng.sample(list(tasks), min(config.batch_size, len(tasks))):
            prompt = tokenizer.chat_prompt(task.messages)
            answer = tokenizer.completion(task.answer)
            sequences.append(prompt + answer)
            masks.append([False] * len(prompt) + [True] * len(answer))
        loss = trainer.supervised_step(sequences, masks, optimizer)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses
