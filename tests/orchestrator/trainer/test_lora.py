"""LoRA (``trainer.lora``): only the adapters train, the update carries only them, and an engine
that applies them holds the trainer's (merged) weights."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from helpers import make_groups

from orchestrator.algo.grpo import GRPO
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.errors import ConfigError
from orchestrator.models.policy import tiny_policy
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.lora import LoraConfig

MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 128,
         "num_layers": 2, "num_heads": 4, "intermediate_size": 512, "seed": 0, "device": "cpu"}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def trainer(**options: Any) -> TorchTrainer:
    policy = tiny_policy(**{k: v for k, v in MODEL.items() if k != "_target_"})
    return TorchTrainer(policy, GRPO(), lr=1e-2, **options)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_adapters_train_and_the_update_carries_only_them() -> None:
    lora = trainer(lora=LORA)
    full = trainer()
    first = anyio.run(lora.weights)  # the engines' start: base weights and adapters
    full_bytes = anyio.run(full.weights).nbytes
    base = {k: v.clone() for k, v in first.tensors().items() if "::" not in k}

    lora.train_step(make_groups())
    update = anyio.run(lora.weights)
    assert update.adapters is not None and update.version == 1
    assert all("::lora_" in name for name in update.tensors())
    assert len(update.adapters.modules) == 2 * 4  # layers x target modules
    assert update.nbytes < 0.05 * full_bytes, (update.nbytes, full_bytes)
    frozen = {n for n, p in lora.model.named_parameters() if not p.requires_grad}
    assert frozen and all(".lora_" not in n for n in frozen)
    assert all(".lora_" in n for n, p in lora.model.named_parameters() if p.requires_grad)
    # The base weights did not move: the step changed the adapters only.
    again = {k: v for k, v in lora.model.state_dict().items() if ".lora_" not in k}
    assert len(again) == len(base)
    for tensor in again.values():
        assert any(tensor.shape == b.shape and torch.equal(tensor, b) for b in base.values())


def test_an_engine_applying_adapters_computes_what_the_trainer_does() -> None:
    lora = trainer(lora=LORA)

    async def main() -> TorchEngine:
        async with TorchEngine(MODEL, await lora.weights()) as engine:
            for _ in range(2):
                lora.train_step(make_groups())
                await engine.pause()
                await engine.update_weights(await lora.weights())
                await engine.resume()
        return engine

    engine = anyio.run(main)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    assert engine.version == 2
    torch.testing.assert_close(logits(engine.model, ids), logits(lora.model, ids),
                               atol=1e-5, rtol=0)


def test_lora_options_are_checked_in_one_sentence() -> None:
    assert LoraConfig.of({"r": 0}) is None and LoraConfig.of(None) is None
    with pytest.raises(ConfigError, match="unknown key trainer.lora.rank"):
        LoraConfig.of({"rank": 4})
    with pytest.raises(ConfigError, match="trainer.lora.target_modules names"):
        trainer(lora={"r": 4, "target_modules": ["query"]})
    with pytest.raises(ConfigError, match="cannot adapt lm_head"):
        LoraConfig.of({"r": 4, "target_modules": ["q_proj", "lm_head"]})
