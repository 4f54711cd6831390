"""``engine=vllm`` on a CUDA GPU: a weight update by each ``engine.weight_transfer`` backend,
and a colocated engine's sleep and wake around it; each checks the version labels and that
the new weights are the ones served (log-probs against the trainer's own forward pass).

Needs vLLM's GPU wheel and CUDA (skipped otherwise; ``scripts/test_gpu.sh`` runs them). What
each needs: ``rpc`` and ``ipc`` one GPU (the "trainer" here is a policy on ``cuda:0`` in this
process, the engine's worker on the same GPU); ``nccl`` two (the trainer on ``cuda:1``, since
NCCL refuses two ranks on one device), skipped with one. Not yet run on a GPU: written against
vLLM 0.32's source on a CPU machine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here")

from orchestrator.engines.base import sync_weights
from orchestrator.engines.placement import Placement
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import build_policy
from orchestrator.types import SamplingParams
from orchestrator.weights.update import WeightUpdate

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 64, "num_layers": 2,
         "num_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256,
         "dtype": "float32", "device": "cuda:0", "seed": 0}
ENGINE = {"max_num_seqs": 16, "enforce_eager": True}
PROMPTS = [[7, 8, 9], [10, 11, 12, 13], [14, 15]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def policy_on(device: str, seed: int) -> Any:
    return build_policy({**MODEL, "device": device, "seed": seed})


def teacher_forced(model: torch.nn.Module, prompt: Sequence[int],
                   generated: Sequence[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(generated)], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1, device=device)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(list(generated),
                                                                     device=device)].cpu()


async def serves(engine: VLLMEngine, model: torch.nn.Module, version: int) -> None:
    """Every token labelled ``version`` and scored as ``model`` scores it."""
    with anyio.fail_after(120):
        for prompt in PROMPTS:
            gen = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0))
            assert gen.versions == (version,) * len(gen.token_ids)
            diff = (torch.tensor(gen.logprobs) - teacher_forced(model, prompt, gen.token_ids)).abs()
            assert float(diff.max()) < 1e-2, (version, float(diff.max()))


async def update_and_serve(engine: VLLMEngine, trainer_device: str) -> None:
    first = policy_on(trainer_device, seed=0)
    await serves(engine, first.model, 1)
    second = policy_on(trainer_device, seed=1)  # other weights, on the trainer's GPU
    await engine.sleep()  # a no-op unless colocated
    await sync_weights(engine, WeightUpdate.of_module(2, second.model))
    await serves(engine, second.model, 2)
    await sync_weights(engine, WeightUpdate.of_module(3, first.model))  # and back
    await serves(engine, first.model, 3)


@pytest.mark.parametrize("backend", ["rpc", "ipc"])
async def test_a_weight_update_on_one_gpu(backend: str) -> None:
    trainer = policy_on("cuda:0", seed=0)
    async with VLLMEngine(MODEL, WeightUpdate.of_module(1, trainer.model), weight_transfer=backend,  # type: ignore[arg-type]
                          placement=Placement(trainer_gpu=0), gpu_memory_utilization=0.3,
                          **ENGINE) as engine:
        assert engine.transfer == backend
        await update_and_serve(engine, "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs a second GPU for the trainer")
async def test_a_weight_update_over_nccl_from_the_trainers_own_gpu() -> None:
    trainer = policy_on("cuda:1", seed=0)
    async with VLLMEngine({**MODEL, "device": "cuda:1"}, WeightUpdate.of_module(1, trainer.model),
                          placement=Placement(trainer_gpu=1), gpu_memory_utilization=0.3,
                          **ENGINE) as engine:
        assert engine.transfer == "nccl"  # auto
        await update_and_serve(engine, "cuda:1")


async def test_a_colocated_engine_sleeps_and_wakes_around_an_update() -> None:
    trainer = policy_on("cuda:0", seed=0)
    async with VLLMEngine(MODEL, WeightUpdate.of_module(1, trainer.model),
                          placement=Placement(trainer_gpu=0, colocate=True), **ENGINE) as engine:
        assert engine.transfer == "ipc"  # auto, on the shared GPU
        assert 0.1 <= engine._options["gpu_memory_utilization"] <= 0.9
        free_awake = torch.cuda.mem_get_info(0)[0]
        await engine.sleep()
        assert torch.cuda.mem_get_info(0)[0] > free_awake  # the weights and KV cache went away
        await sync_weights(engine, WeightUpdate.of_module(1, trainer.model))
        await update_and_serve(engine, "cuda:0")
