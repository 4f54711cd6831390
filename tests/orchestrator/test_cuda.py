"""The CUDA paths (marked ``gpu``, skipped without a GPU; ``bash scripts/test_gpu.sh`` runs
them): the torch engine and the trainer on a GPU in float32 and bf16 with their log-prob
agreement, every tensor of an engine step on the device, a LoRA update, and trainer ranks
(FSDP2 over NCCL) on the GPUs present."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch
from helpers import make_groups

from envs.registry import make_spec
from orchestrator.algo.grpo import GRPO
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.slot_cache import SlotCache
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.policy import build_policy
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer import TorchTrainer, token_batch
from orchestrator.types import Group, SamplingParams
from orchestrator.weights.update import WeightUpdate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL: dict[str, Any] = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 64,
                         "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
                         "device": "cuda", "seed": 0}


async def _groups(engine: TorchEngine, node: dict[str, Any], tasks: int = 4,
                  size: int = 4) -> list[Group]:
    spec = make_spec("arithmetic", digits=2, train_size=16, eval_size=4)
    tokenizer = build_policy(node).tokenizer
    runner = EpisodeRunner(engine, tokenizer, spec, RolloutConfig(group_size=size), Recorder())
    return [(await runner.group(task, "w")).group for task in spec.tasks("train")[:tasks]]


def _gap(trainer: TorchTrainer, groups: Sequence[Group]) -> tuple[float, float]:
    """Mean and max |engine - trainer| log-prob over the sampled tokens, same weights."""
    trajectories = [t for g in groups for t in g.trajectories]
    batch = token_batch([t.token_ids for t in trajectories], [t.loss_mask for t in trajectories],
                        trainer.policy.tokenizer.pad_id,
                        behaviour=[t.logprobs for t in trajectories])
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
    gap = (logp.float().cpu() - batch.behaviour_logprobs).abs() * batch.mask
    return float(gap.sum() / batch.mask.sum()), float(gap.max())


@pytest.mark.anyio
async def test_engine_and_trainer_on_cuda() -> None:
    policy = build_policy(MODEL)
    trainer = TorchTrainer(policy, GRPO(), lr=1e-3, precision="fp32")
    async with TorchEngine(MODEL, WeightUpdate.of_module(0, policy.model)) as engine:
        groups = await _groups(engine, MODEL)
    mean, worst = _gap(trainer, groups)
    assert worst < 1e-3, (mean, worst)  # engine (KV cache, left padding) and trainer agree
    metrics = await trainer.step(groups)
    assert trainer.version == 1
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert next(policy.model.parameters()).device.type == "cuda"


@pytest.mark.parametrize(("engine_dtype", "precision", "fp32_head", "bound"), [
    ("float32", "fp32", False, 1e-3),
    ("bfloat16", "mixed", False, 0.5),
    ("bfloat16", "mixed", True, 0.5),
    ("bfloat16", "bf16", True, 0.5),
])
@pytest.mark.anyio
async def test_precision_policies_on_cuda(engine_dtype: str, precision: str, fp32_head: bool,
                                          bound: float) -> None:
    """Each policy trains on the GPU, master weights in their dtype, and the engine/trainer
    log-prob gap is measured (printed; bench.precision measures it on SmolLM2)."""
    node = {**MODEL, "dtype": engine_dtype, "fp32_head": fp32_head}
    policy = build_policy(node)
    trainer = TorchTrainer(policy, GRPO(), lr=1e-3, precision=precision)
    master = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in trainer.model.parameters()} == {master}
    async with TorchEngine(node, WeightUpdate.of_module(0, build_policy(node).model)) as engine:
        groups = await _groups(engine, node)
        mean, worst = _gap(trainer, groups)
        print(f"engine {engine_dtype}, trainer {precision}, fp32 head {fp32_head}: "
              f"logprob_diff mean {mean:.2e} max {worst:.2e}")
        assert mean < bound
        metrics = await trainer.step(groups)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        await engine.pause()
        update = await trainer.weights()
        await engine.update_weights(update)
        update.release()
        await engine.resume()
        after = await _groups(engine, node, tasks=2)
    assert engine.version == 1 and all(t.versions[-1] == 1 for g in after for t in g.trajectories)


def test_every_step_tensor_is_on_the_gpu() -> None:
    cache = SlotCache(8, device="cuda")
    cache.end = 6
    layout = cache.begin([1, 1, 2, 5, 6], [4, 6, 3, 5, 6])
    layout.masks(None)
    layout.masks(3)
    assert {t.device.type for t in layout.tensors()} == {"cuda"}


@pytest.mark.anyio
async def test_lora_update_on_cuda() -> None:
    policy = build_policy(MODEL)
    trainer = TorchTrainer(policy, GRPO(), lr=1e-2, precision="mixed",
                           lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    async with TorchEngine(MODEL, None) as engine:
        await engine.pause()
        first = await trainer.weights()  # the base weights and the adapters
        await engine.update_weights(first)
        await engine.resume()
        groups = await _groups(engine, MODEL)
        await trainer.step(groups)
        await engine.pause()
        update = await trainer.weights()
        assert update.adapters is not None and update.nbytes < first.nbytes
        await engine.update_weights(update)
        await engine.resume()
        after = await _groups(engine, MODEL, tasks=2)
        mean, _ = _gap(trainer, after)  # the merged engine agrees with the adapted trainer
    assert mean < 0.05, mean


def test_trainer_ranks_over_nccl() -> None:
    """FSDP2 over NCCL on every GPU present (one here: world size 1, the same code path), in
    mixed precision (FSDP2's MixedPrecisionPolicy): a step, then the gathered weights."""
    from orchestrator.launch import LocalLauncher, TrainerRecipe
    from orchestrator.launch.ranks import RankGroup

    world = torch.cuda.device_count()
    recipe = TrainerRecipe(
        trainer={"_target_": "orchestrator.trainer.TorchTrainer", "lr": 1e-3,
                 "micro_batch_size": 3, "precision": "mixed", "world_size": world},
        model={**MODEL, "hidden_size": 32, "intermediate_size": 64},
        algo={"_target_": "orchestrator.algo.grpo.GRPO"}, torch_threads=1)
    with LocalLauncher() as launcher:
        group = launcher.trainer(recipe)
        assert isinstance(group, RankGroup)
        metrics = anyio.run(group.step, make_groups())
        weights = anyio.run(group.weights).tensors()
    assert group.version == 1 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # gathered in compute dtype


def test_the_engine_waits_for_the_gpu_once_a_step() -> None:
    """An engine step's inputs, masks, indices and sampling stay on the GPU: the host waits
    for it once a step (its tokens and log-probs, copied together), not once per row or per
    token. (Counted with CUDA's sync debug mode; a blocking copy to the GPU counts too.)"""
    from bench.gpu import HostSyncs

    tokens, prompts = 12, [[1, 5, 7, 9], [1, 4, 4], [1, 6, 7, 8, 9, 10]]
    sampling = SamplingParams(max_tokens=tokens, temperature=1.0)

    async def round_of(engine: TorchEngine) -> None:
        async with anyio.create_task_group() as tg:
            for ids in prompts:
                tg.start_soon(engine.generate, ids, sampling)

    async def run() -> int:
        async with TorchEngine(MODEL, None, max_batch_size=8) as engine:
            await round_of(engine)  # warm-up
            with HostSyncs() as waits:
                await round_of(engine)
        return waits.count

    waits = anyio.run(run)
    print(f"host waits: {waits} in {tokens} steps")
    assert waits <= tokens + 2, waits
