"""The CUDA paths: the torch engine and the trainer on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from envs.registry import make_spec
from orchestrator.algo.grpo import GRPO
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.recorder import Recorder
from orchestrator.rollout import EpisodeRunner, RolloutConfig
from orchestrator.trainer import TorchTrainer, pack
from orchestrator.weights import WeightUpdate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.anyio
async def test_engine_and_trainer_on_cuda() -> None:
    from orchestrator.models.policy import tiny_policy

    policy = tiny_policy(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, device="cuda")
    spec = make_spec("arithmetic", digits=2, train_size=16, eval_size=4)
    trainer = TorchTrainer(policy, GRPO(), lr=1e-3)
    model = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 64,
             "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "device": "cuda"}
    async with TorchEngine(model, WeightUpdate.of_module(0, policy.model)) as engine:
        groups = [
            (await EpisodeRunner(engine, policy.tokenizer, spec, RolloutConfig(group_size=4),
                                 Recorder()).group(task, "w")).group
            for task in spec.tasks("train")[:4]
        ]
    trajectories = [t for g in groups for t in g.trajectories]
    batch = pack([t.token_ids for t in trajectories], [t.loss_mask for t in trajectories],
                 policy.tokenizer.pad_id, behaviour=[t.logprobs for t in trajectories])
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
    gap = ((logp.cpu() - batch.behaviour_logprobs) * batch.mask).abs().max().item()
    assert gap < 1e-3  # engine (KV cache, left padding) and trainer agree on the GPU too

    metrics = await trainer.step(groups)
    assert trainer.version == 1
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert next(policy.model.parameters()).device.type == "cuda"
