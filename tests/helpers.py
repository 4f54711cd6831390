"""Helpers shared by tests: a scripted inference engine (it replies with a function of the
prompt) and a composed config for a seconds-long run of any experiment."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import Policy
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import WeightUpdate

TOK = CharTokenizer()
# The tests' tiny model as a conf/model node: engines are built from it, never from a policy.
TINY_MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 32,
              "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "device": "cpu"}
REPO = Path(__file__).resolve().parents[1]


class ScriptedEngine(InferenceEngine):
    """Replies with ``reply(prompt)`` (then the first stop token), log-prob -0.5 per token."""

    def __init__(self, reply: Any, version: int = 3) -> None:
        self.reply = reply
        self.version = version
        self.prompts: list[list[int]] = []
        self.sampling: list[SamplingParams] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.sampling.append(sampling)
        ids = TOK.encode(self.reply(list(prompt_ids)))[: sampling.max_tokens - 1] + [sampling.stop_token_ids[0]]
        return Generation(tuple(ids), tuple([-0.5] * len(ids)), tuple([self.version] * len(ids)),
                          FinishReason.STOP, self.version)

    async def update_weights(self, update: WeightUpdate) -> None:
        self.version = update.version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass


def engine_for(policy: Policy, cls: type[TorchEngine] | None = None, **kwargs: Any) -> TorchEngine:
    """A torch engine built from the tiny model's config, starting from ``policy``'s weights."""
    return (cls or TorchEngine)(TINY_MODEL, WeightUpdate.of_module(0, policy.model), **kwargs)


def quick_config(experiment: str, *overrides: str) -> DictConfig:
    """``experiment`` shrunk to a run of seconds: a one-layer model, two steps of 8 samples."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            f"experiment={experiment}", "logger=none", "progress=false", "model.device=cpu",
            "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
            "pipeline.num_steps=2", "pipeline.batch_size=8", "pipeline.num_workers=2",
            "warmstart.steps=2", "warmstart.target_accuracy=null", "eval.num_tasks=4",
            "env.train_size=32", "env.eval_size=4", *overrides])
