"""The supervised warm start (orchestrator/run/warmstart.py)."""

from __future__ import annotations

from typing import Any

import anyio

from envs.arithmetic import ArithmeticSpec
from orchestrator.algo.grpo import GRPO
from orchestrator.config.schema import WarmStartConfig
from orchestrator.run.warmstart import warm_start
from orchestrator.trainer import TorchTrainer


def test_no_steps_no_change(tiny: Any) -> None:
    trainer = TorchTrainer(tiny, GRPO())
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    assert anyio.run(warm_start, trainer, tiny.tokenizer, [], WarmStartConfig(steps=0)) == []
    assert all((before[k] == v).all() for k, v in tiny.model.state_dict().items())


def test_warm_start_lowers_the_loss_and_reports_each_step(tiny: Any) -> None:
    tasks = ArithmeticSpec(train_size=32, eval_size=0).tasks("train")
    trainer = TorchTrainer(tiny, GRPO())
    seen: list[tuple[int, float]] = []
    losses = anyio.run(lambda: warm_start(
        trainer, tiny.tokenizer, tasks, WarmStartConfig(steps=8, batch_size=16, lr=3e-3),
        on_step=lambda step, loss: seen.append((step, loss))))
    assert len(losses) == 8 and [s for s, _ in seen] == list(range(8))
    assert [loss for _, loss in seen] == losses
    assert losses[-1] < losses[0]
    assert trainer.version == 0  # the RL version counts RL steps only
    assert trainer.optimizer.state_dict()["state"] == {}  # the RL optimiser starts fresh


def test_warm_start_stops_early_at_the_target_accuracy(tiny: Any) -> None:
    tasks = ArithmeticSpec(train_size=16, eval_size=0).tasks("train")
    trainer = TorchTrainer(tiny, GRPO())
    checks = iter([0.1, 0.4, 0.6, 0.9])
    asked: list[int] = []

    async def accuracy() -> float:
        asked.append(1)
        return next(checks)

    config = WarmStartConfig(steps=20, batch_size=4, target_accuracy=0.5, check_every=2)
    losses = anyio.run(lambda: warm_start(trainer, tiny.tokenizer, tasks, config,
                                          accuracy=accuracy))
    assert len(asked) == 3  # checks after steps 2, 4 and 6; the third reaches 0.5
    assert len(losses) == 6
    # without a target the check is never asked for
    asked.clear()
    losses = anyio.run(lambda: warm_start(
        trainer, tiny.tokenizer, tasks, WarmStartConfig(steps=4, batch_size=4, check_every=1),
        accuracy=accuracy))
    assert asked == [] and len(losses) == 4
