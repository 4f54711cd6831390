"""An opening prompt longer than the model's context, or a tokenizer bigger than the model's
vocabulary, is one line naming what to change, not a silent empty sample or a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_MODEL, build_hf_checkpoint

from envs.arithmetic import ArithmeticSpec
from orchestrator.config.schema import RolloutConfig
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.models.policy import pretrained_policy, tiny_policy
from orchestrator.trace.recorder import Recorder
from orchestrator.weights.update import WeightUpdate


@pytest.mark.anyio
async def test_a_prompt_longer_than_the_context_is_named() -> None:
    from orchestrator.engines.torch_engine import TorchEngine

    model = {**TINY_MODEL, "max_position_embeddings": 8}
    policy = tiny_policy(**{k: v for k, v in model.items() if k != "_target_"})
    spec = ArithmeticSpec()
    async with TorchEngine(model, WeightUpdate.of_module(0, policy.model)) as engine:
        with pytest.raises(ConfigError, match=r"is \d+ tokens and the model's context is 8: "
                                              r"use a model with a longer context") as error:
            await EpisodeRunner(engine, policy.tokenizer, spec, RolloutConfig(group_size=1),
                                Recorder()).episode(spec.tasks("train")[0], "w")
    assert "\n" not in str(error.value)


def test_a_tokenizer_bigger_than_the_models_vocabulary_is_named(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_hf_checkpoint(tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(path)
    config.vocab_size = 16  # fewer rows than the tokenizer has tokens
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    with pytest.raises(ConfigError, match="tokenizer has .* tokens but the model's vocabulary has 16"):
        pretrained_policy(str(path), dtype="float32", device="cpu")
