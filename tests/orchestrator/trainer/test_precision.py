"""The precision policy (``trainer.precision``) and the fp32 LM head (``model.fp32_head``):
master weights stay float32 while the forward pass computes in bf16, the head's logits are
float32 on both sides, and bad values fail in one line naming the key."""

from __future__ import annotations

import anyio
import pytest
import torch
from helpers import make_groups

from orchestrator.algo.grpo import GRPO
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.errors import ConfigError
from orchestrator.models.policy import Fp32Head, build_policy, tiny_policy
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.precision import Precision
from orchestrator.types import SamplingParams
from orchestrator.weights.update import WeightUpdate

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
         "seed": 0, "device": "cpu"}
CPU = torch.device("cpu")


def test_resolve() -> None:
    assert Precision.resolve("auto", CPU, torch.float32) == Precision("fp32", torch.float32, None)
    assert Precision.resolve("auto", CPU, torch.bfloat16).weights == torch.bfloat16  # as loaded
    assert Precision.resolve("mixed", CPU, torch.bfloat16) == Precision("mixed", torch.float32,
                                                                        torch.bfloat16)
    assert Precision.resolve("bf16", CPU, torch.float32).weights == torch.bfloat16
    assert Precision.resolve("fp32", CPU, torch.bfloat16).compute is None
    with pytest.raises(ConfigError, match=r"^trainer.precision=half must be one of auto, fp32, "):
        Precision.resolve("half", CPU, torch.float32)


def test_mixed_keeps_float32_master_weights_and_computes_in_bf16() -> None:
    policy = tiny_policy(**SMALL, dtype="bfloat16")
    trainer = TorchTrainer(policy, GRPO(), lr=1e-3, micro_batch_size=4, precision="mixed")
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    seen: list[torch.dtype] = []
    layer = trainer.model.model.layers[0].self_attn.q_proj
    hook = layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(make_groups())
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran under bf16 autocast
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    state = trainer.optimizer.state[next(trainer.model.parameters())]
    assert state["exp_avg"].dtype == torch.float32  # the optimiser's moments too
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and {trainer.model.get_parameter(n).dtype for n in moved} == {torch.float32}
    update = trainer.model.state_dict()  # what the engines get: fp32, cast on load
    assert update["model.embed_tokens.weight"].dtype == torch.float32


def test_bf16_trains_in_bf16() -> None:
    trainer = TorchTrainer(tiny_policy(**SMALL), GRPO(), lr=1e-3, precision="bf16")
    trainer.train_step(make_groups())
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


def test_fp32_head_gives_float32_logits_under_bf16_and_autocast() -> None:
    policy = tiny_policy(**SMALL, dtype="bfloat16", fp32_head=True)
    model = policy.model
    assert type(model.get_output_embeddings()) is Fp32Head
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32
    hidden = out.hidden_states[-1]  # after the final norm: what the head reads
    expected = hidden.float() @ model.get_output_embeddings().weight.float().T
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0)
    plain = tiny_policy(**SMALL, dtype="bfloat16").model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16  # without it: rounded to bf16


def test_fp32_head_reaches_the_engine_from_the_same_model_node() -> None:
    node = {"_target_": "orchestrator.models.policy.tiny_policy", **SMALL, "dtype": "bfloat16",
            "fp32_head": True}

    async def run() -> tuple[int, ...]:
        async with TorchEngine(node, WeightUpdate.of_module(0, build_policy(node).model)) as engine:
            assert type(engine.model.get_output_embeddings()) is Fp32Head
            return (await engine.generate([1, 5, 7], SamplingParams(max_tokens=4))).token_ids

    assert len(anyio.run(run)) == 4


def test_fp32_head_needs_a_plain_linear_head() -> None:
    from orchestrator.models.policy import with_fp32_head

    class NoHead(torch.nn.Module):
        def get_output_embeddings(self) -> None:
            return None

    with pytest.raises(ConfigError, match="^model.fp32_head=true needs an LM head"):
        with_fp32_head(NoHead())


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_mixed_under_trainer_ranks_is_fsdp2_mixed_precision() -> None:
    """Two ranks over gloo: FSDP2 gathers the parameters in bf16 and reduces gradients in
    float32 (no autocast); the engines get the gathered bf16 weights."""
    from orchestrator.launch import TrainerRecipe
    from orchestrator.launch.ranks import process_group

    recipe = TrainerRecipe(
        trainer={"_target_": "orchestrator.trainer.TorchTrainer", "lr": 1e-3,
                 "micro_batch_size": 3, "precision": "mixed", "world_size": 2},
        model={"_target_": "orchestrator.models.policy.tiny_policy", **SMALL},
        algo={"_target_": "orchestrator.algo.grpo.GRPO"}, torch_threads=1)
    group = process_group(recipe, 2)
    try:
        metrics = anyio.run(group.step, make_groups())
        weights = anyio.run(group.weights).tensors()
    finally:
        group.close()
    assert group.version == 1 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_a_gpu_index_this_process_does_not_see_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.models.policy import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError) as caught:  # before: CUDA's "invalid device ordinal", later
        resolve_device("cuda:2")
    assert str(caught.value).startswith("model.device=cuda:2 but this process sees 2 GPU(s), "
                                        "cuda:0 to cuda:1")
