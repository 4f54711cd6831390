"""LoRA (``trainer.lora``): low-rank adapters from ``peft`` on the policy; only they train.

``trainer.lora.r > 0`` wraps the model with ``peft``'s LoRA on ``target_modules`` (the
attention projections by default); the base weights are frozen, so the optimiser holds state
for the adapters alone and the :class:`~orchestrator.weights.update.WeightUpdate` a step produces
carries only the adapter tensors (:func:`adapter_update`): ``<weight>::lora_A`` and
``<weight>::lora_B`` for each adapted weight, named as in the plain model, with the scale
``alpha / r`` in :class:`~orchestrator.weights.update.Adapters`. An engine applies them to the base
weights it kept (:class:`~orchestrator.weights.update.AdapterMerger`: ``W = W0 + scale * B @ A``,
merged weights, not a LoRA kernel at decode time). The first update a trainer hands out
carries the base weights too, so the engine built from it has them.

The supervised warm start trains every weight, base included (it stands for the pre-training
a LoRA run starts from: the default task's model starts from random weights, where adapters
alone cannot learn it); the update after it carries the base weights again. RL trains the
adapters only; ``warmstart.steps=0`` keeps the base weights as loaded.

Limits: no dropout on the adapters (the trainer scores tokens in eval mode); biases and
embeddings are not adapted.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from orchestrator.errors import ConfigError
from orchestrator.weights.update import Adapters, WeightUpdate

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraConfig:
    r: int = 0  # the adapters' rank; 0: no LoRA (full fine-tuning)
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> LoraConfig | None:
        """The config ``trainer.lora`` describes, or None when ``r`` is 0 (or it is absent)."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        for name in values:
            if name not in known:
                raise ConfigError(f"unknown key trainer.lora.{name}: expected one of {sorted(known)}")
        if "target_modules" in values:
            values["target_modules"] = tuple(values["target_modules"] or ())
        made = cls(**values)
        if not isinstance(made.r, int) or made.r < 0:
            raise ConfigError(f"trainer.lora.r must be an integer >= 0, got {made.r!r}")
        if made.r == 0:
            return None
        if made.alpha <= 0:
            raise ConfigError(f"trainer.lora.alpha must be > 0, got {made.alpha}")
        if not made.target_modules:
            raise ConfigError("trainer.lora.target_modules is empty: name the linear layers to "
                              "adapt, e.g. [q_proj, v_proj]")
        if "lm_head" in made.target_modules:  # tied to the embedding in the models here
            raise ConfigError("trainer.lora.target_modules cannot adapt lm_head (the engines tie "
                              "it to the token embedding, which an adapter update would change "
                              "too); adapt the decoder layers' projections")
        return made

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with adapters (``peft``); only their parameters require gradients."""
        try:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model
        except ImportError as error:  # pragma: no cover - a dependency of the project
            raise ConfigError("trainer.lora needs peft: pip install -e .") from error
        names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}
        missing = sorted(set(self.target_modules) - names)
        if missing:
            raise ConfigError(f"trainer.lora.target_modules names {missing}, which the model "
                              f"does not have; its linear layers: {sorted(names)}")
        config = PeftLoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=0.0, bias="none",
                                target_modules=list(self.target_modules))
        with warnings.catch_warnings():  # peft reads a transformers alias deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            return get_peft_model(model, config)


def _plain(name: str) -> str:
    """A wrapped model's parameter name as the plain model names it."""
    return name.removeprefix(_PREFIX).replace(".base_layer.", ".")


def _adapters(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``<weight>::lora_A`` / ``::lora_B`` tensors from a wrapped model's state dict."""
    out = {}
    for name, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module = _plain(name.split(marker)[0])
                out[f"{module}.weight::{part}"] = tensor
    return out


def base_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base weights of a wrapped model's state dict, under the plain model's names."""
    return {_plain(name): t for name, t in state.items() if ".lora_" not in name}


def adapter_update(version: int, state: Mapping[str, torch.Tensor], scale: float,
                   with_base: bool) -> WeightUpdate:
    """The update a LoRA step hands out: copies of the adapters (and the base weights with
    ``with_base``), so the trainer's next step may change its own tensors at once."""
    tensors = {k: v.detach().clone() for k, v in _adapters(state).items()}
    modules = tuple(sorted({k.split("::")[0] for k in tensors}))
    if with_base:
        tensors.update(base_weights(state))  # frozen: never changed, so no copy is needed
    return WeightUpdate.by_reference(version, tensors, leased=False).with_adapters(
        Adapters(scale=scale, modules=modules))


def trainable(model: torch.nn.Module) -> Sequence[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
