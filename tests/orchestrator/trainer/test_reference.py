"""The algorithm family in the torch trainer: the reference policy (a frozen copy, or the base
model under LoRA), KL in the loss and in the reward, the entropy bonus's gradient, masked
samples, sequence metrics, and every preset's pieces on a real step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import REPO, make_groups
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.grpo import GRPO
from orchestrator.algo.regularizers import KL
from orchestrator.algo.shaping import MaskTruncated
from orchestrator.models.policy import tiny_policy
from orchestrator.trainer import TorchTrainer
from orchestrator.types import FinishReason, Group

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
         "seed": 0, "device": "cpu"}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
PRESETS = ["grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_pp", "stale"]


def trainer(algorithm: Any, **options: Any) -> TorchTrainer:
    return TorchTrainer(tiny_policy(**MODEL), algorithm, lr=1e-2, **options)


def test_the_kl_term_is_zero_at_the_first_step_and_grows_after() -> None:
    t = trainer(PolicyGradient(kl=KL(coef=0.1, estimator="k3")))
    assert t._reference_model is not None
    first = t.train_step(make_groups())
    assert first["kl_to_reference"] == pytest.approx(0.0, abs=1e-9)
    second = t.train_step(make_groups(seed=1))
    assert second["kl_to_reference"] > 1e-6


def test_the_reference_is_the_policy_at_the_first_rl_step_not_at_construction() -> None:
    t = trainer(PolicyGradient(kl=KL(coef=0.1)))
    with torch.no_grad():  # a warm start moving the weights before RL
        for p in t.model.parameters():
            p.add_(0.01)
    t.train_step(make_groups())
    warm = {k: v for k, v in t._reference_model.state_dict().items()}
    fresh = tiny_policy(**MODEL).model.state_dict()
    assert any(not torch.equal(warm[k], fresh[k]) for k in fresh)


def test_under_lora_the_reference_is_the_base_model_and_costs_no_parameters() -> None:
    t = trainer(PolicyGradient(kl=KL(coef=0.1)), lora=LORA)
    plain = trainer(GRPO(), lora=LORA)
    assert t._reference_model is None
    count = sum(p.numel() for p in t.model.parameters())
    assert count == sum(p.numel() for p in plain.model.parameters())
    assert t.train_step(make_groups())["kl_to_reference"] == pytest.approx(0.0, abs=1e-9)
    assert t.train_step(make_groups(seed=1))["kl_to_reference"] > 1e-6


def test_the_reference_is_saved_and_resumed() -> None:
    t = trainer(PolicyGradient(kl=KL(coef=0.1)))
    t.train_step(make_groups())
    t.train_step(make_groups(seed=1))
    state = t.state_dict()
    assert "reference" in state
    again = trainer(PolicyGradient(kl=KL(coef=0.1)))
    again.load_state_dict(state)
    assert again._reference_started
    for k, v in t._reference_model.state_dict().items():
        assert torch.equal(again._reference_model.state_dict()[k], v)
    a, b = t.train_step(make_groups(seed=2)), again.train_step(make_groups(seed=2))
    assert a["kl_to_reference"] == pytest.approx(b["kl_to_reference"], rel=1e-6)


def test_kl_in_the_reward_moves_the_advantages() -> None:
    t = trainer(PolicyGradient(kl=KL(coef=1.0, estimator="k1", in_reward=True)))
    t.train_step(make_groups())
    metrics = t.train_step(make_groups(seed=1))
    assert metrics["kl_penalty"] != 0.0 and math.isfinite(metrics["kl_penalty"])
    assert "kl_to_reference" not in metrics or math.isfinite(metrics["kl_to_reference"])


def test_the_entropy_bonus_changes_the_gradient() -> None:
    steps = {}
    for coef in (0.0, 1.0):
        t = trainer(PolicyGradient(entropy_coef=coef))
        steps[coef] = t.train_step(make_groups())["grad_norm"]
    assert steps[0.0] != pytest.approx(steps[1.0])


def test_a_masked_sample_is_not_trained_or_counted() -> None:
    groups = make_groups()
    truncated = [Group(g.prompt_id, tuple(
        t if i else type(t)(**{**t.__dict__, "finish_reason": FinishReason.LENGTH})
        for i, t in enumerate(g.trajectories)), g.start_version) for g in groups]
    full = trainer(PolicyGradient()).train_step(truncated)
    masked = trainer(PolicyGradient(shaping={"t": MaskTruncated()})).train_step(truncated)
    first_tokens = sum(g.trajectories[0].num_generated for g in groups)
    assert masked["trained_tokens"] == full["trained_tokens"] - first_tokens
    assert masked["trained_sequences"] == full["trained_sequences"] - len(groups)
    assert masked["shaping/truncated_masked"] == pytest.approx(0.25)


def test_grpo_preset_is_todays_grpo() -> None:
    composed = trainer(preset("grpo")).train_step(make_groups())
    today = trainer(GRPO()).train_step(make_groups())
    for key, value in today.items():
        assert composed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def preset(name: str, *overrides: str) -> PolicyGradient:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"algo={name}", *overrides])
    values = OmegaConf.to_container(cfg.algo, resolve=True)
    values.pop("filter", None)  # the pipeline's
    return instantiate(values)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("minibatches", [1, 2])
def test_every_preset_trains_a_step(name: str, minibatches: int) -> None:
    t = trainer(preset(name), num_minibatches=minibatches)
    for seed in range(2):
        metrics = t.train_step(make_groups(seed=seed))
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["trained_tokens"] > 0
    assert t.version == 2


def forward_passes(t: TorchTrainer) -> int:
    """How many times one train step computes log-probs (micro-batch forward passes)."""
    calls = []
    original = t._logprobs

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    t._logprobs = counted  # type: ignore[method-assign]
    t.train_step(make_groups())
    return len(calls)


def test_bypass_skips_the_proximal_pass() -> None:
    bypass = forward_passes(trainer(preset("grpo", "algo.mode=bypass"), num_minibatches=2))
    decoupled = forward_passes(trainer(preset("grpo"), num_minibatches=2))
    assert bypass < decoupled


def test_a_step_with_nothing_to_train_moves_neither_weights_nor_schedule() -> None:
    # zero-variance masking can leave a step nothing at all, the very first one too
    t = trainer(PolicyGradient(), warmup_steps=4)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    metrics = t.train_step([])  # warnings are errors here: no scheduler-before-optimiser one
    assert t.version == 1 and metrics["trained_tokens"] == 0.0
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items())
    assert t.scheduler.last_epoch == 0
    t.train_step(make_groups())
    assert t.scheduler.last_epoch == 1
