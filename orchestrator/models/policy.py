"""The policy: a causal LM from ``transformers`` and the tokenizer that goes with it.

Two ways in, one config group (``conf/model/``):

* :func:`tiny_policy` builds a small model from a standard architecture config
  (``model_type`` is any that ``transformers`` knows, Llama by default) with random weights
  and the project's character tokenizer; nothing is downloaded.
* :func:`pretrained_policy` loads any local Hugging Face causal-LM directory with its own
  tokenizer and chat template, or a GGUF file (``model.gguf``: a path, or ``smollm2`` for
  the packaged SmolLM2-135M-Instruct) converted once into such a directory in the cache
  (:mod:`orchestrator.models.gguf`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.errors import ConfigError
from orchestrator.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: Tokenizer
    device: torch.device


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """A ``peft`` model's wrapped model (it passes its forward's arguments on), else ``model``."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


# An attention mask that transformers hands to a registered attention unchanged (a 4-D mask
# is taken as prepared): for attentions that read their own layout (the torch engine's step,
# the trainer's packed groups) instead of a mask.
PASSTHROUGH_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def forward_parameters(model: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    """The parameters of ``model``'s forward (a ``peft`` model's: of the model it wraps)."""
    return inspect.signature(_unwrapped(model).forward).parameters


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward computes logits at chosen positions only (``transformers``'
    ``logits_to_keep``) given as a 2-D mask."""
    target = _unwrapped(model)
    if "logits_to_keep" not in forward_parameters(target):
        return False
    # The trained positions go in as a 2-D boolean mask, which transformers takes from 5.20 on
    # (its modeling code slices through slice_logits_to_keep); before that a tensor indexes
    # the sequence axis only, the same positions for every row.
    return any(hasattr(sys.modules.get(cls.__module__), "slice_logits_to_keep")
               for cls in type(target).__mro__)


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its KV cache by, and its output returns it by:
    ``cache`` from transformers 5.24 on (which warns on the old name), ``past_key_values``
    before (``.venv-vllm`` pins an older one)."""
    parameters = forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    import transformers  # a wrapper passing **kwargs on: what this transformers' models take
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"


class Fp32Head(torch.nn.Linear):
    """An LM head that computes its logits in float32 whatever its weights' dtype and any
    autocast around it (``model.fp32_head``): bf16 rounding of the logits is the largest
    source of engine/trainer log-prob disagreement in bf16 (a logit near 20 is rounded by up
    to 0.06). The engine and the trainer build their models from the same ``conf/model``
    node, so both sides get it or neither does. Costs a float32 copy of the head's weight per
    forward pass when the weights are bf16."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def with_fp32_head(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its LM head computing in float32 (:class:`Fp32Head`), in place."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"model.fp32_head=true needs an LM head that is a linear layer; "
                          f"{type(model).__name__}'s is {type(head).__name__}")
    if type(head) is torch.nn.Linear:  # a subclass (an adapter, a quantised layer) is left be
        head.__class__ = Fp32Head
    elif not isinstance(head, Fp32Head):
        raise ConfigError(f"model.fp32_head=true: {type(model).__name__}'s LM head is a "
                          f"{type(head).__name__}, which this option cannot change")
    return model


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={device} but no CUDA device is visible; use model.device=cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None:
        visible = torch.cuda.device_count()
        if resolved.index >= visible:
            raise ConfigError(
                f"model.device={device} but this process sees {visible} GPU(s), cuda:0 to "
                f"cuda:{visible - 1} (a Ray actor sees only the GPUs it was given, each as from "
                "cuda:0): use model.device=cuda, or choose the GPUs with CUDA_VISIBLE_DEVICES")
    return resolved


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype={name} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _check_dtype(name: str, device: torch.device) -> None:
    """A bf16 model on a GPU that cannot compute in bf16 (before Ampere): one line, now."""
    if name == "bfloat16" and device.type == "cuda" and \
            not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ConfigError(f"model.dtype=bfloat16 but this GPU ({torch.cuda.get_device_name(device)}) "
                          "does not compute in bf16; use model.dtype=float32 or float16")


def tiny_policy(
    architecture: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "auto",
    fp32_head: bool = False,
) -> Policy:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = CharTokenizer()
    try:
        config = AutoConfig.for_model(
            architecture,
            vocab_size=tokenizer.vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_id,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.end_id,
        )
    except ValueError as e:
        raise ConfigError(f"model.architecture={architecture} is not a transformers model type") from e
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype), attn_implementation="eager")
    target = resolve_device(device)
    _check_dtype(dtype, target)
    if fp32_head:
        with_fp32_head(model)
    return Policy(model=model.to(target), tokenizer=tokenizer, device=target)


def pretrained_policy(path: str | None = None, dtype: str = "bfloat16", device: str = "auto",
                      gguf: str | None = None, fp32_head: bool = False) -> Policy:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load (engines, trainer) is noise in a run's log
    path = str(checkpoint_dir({"path": path, "gguf": gguf}))
    tokenizer = HFTokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={path} could not be loaded as a causal LM: {e}") from e
    vocab = model.get_input_embeddings().num_embeddings
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"model.path={path}: its tokenizer has {tokenizer.vocab_size} tokens "
                          f"but the model's vocabulary has {vocab}; the tokenizer is not this "
                          "model's (give a checkpoint directory holding both)")
    target = resolve_device(device)
    _check_dtype(dtype, target)
    if fp32_head:
        with_fp32_head(model)
    return Policy(model=model.to(target), tokenizer=tokenizer, device=target)


def checkpoint_dir(config: Mapping[str, Any]) -> Path | None:
    """The Hugging Face directory a ``conf/model`` node loads from (``path``, or ``gguf``
    converted into the cache), or None for a model built from config."""
    path, gguf = config.get("path"), config.get("gguf")
    if path is not None and gguf is not None:
        raise ConfigError("model.path and model.gguf are both set; give one")
    if gguf is not None:
        from orchestrator.models.gguf import converted

        return converted(gguf)
    if path is None:
        if "path" in config or "gguf" in config:
            raise ConfigError("model.path (a Hugging Face directory) or model.gguf (a .gguf file "
                              "or smollm2) must be set")
        return None
    if not Path(path).is_dir() or not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path={path} is not a local Hugging Face checkpoint directory "
                          "(no config.json); give a directory written by save_pretrained, or "
                          "model.gguf=<file.gguf> to convert one")
    return Path(path)


def model_context(config: Mapping[str, Any]) -> int | None:
    """The most positions the model a ``conf/model`` node describes takes (its
    ``max_position_embeddings``: the node's own, else its checkpoint's ``config.json``), None
    if neither says; read without building the model."""
    if config.get("max_position_embeddings") is not None:
        return int(config["max_position_embeddings"])
    directory = checkpoint_dir(config) if ("path" in config or "gguf" in config) else None
    if directory is None:
        return None
    import json

    value = json.loads((directory / "config.json").read_text()).get("max_position_embeddings")
    return int(value) if value is not None else None


def build_tokenizer(config: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a ``conf/model`` node describes, without building its model (a driver
    whose trainer lives in another process needs only this); a model target this module does
    not know is built whole for its tokenizer."""
    from hydra.utils import get_object

    target = get_object(str(config.get("_target_")))
    if target is tiny_policy:
        return CharTokenizer()
    if target is pretrained_policy:
        return HFTokenizer(str(checkpoint_dir({"path": config.get("path"),
                                               "gguf": config.get("gguf")})))
    return build_policy(config).tokenizer


def build_policy(config: Mapping[str, Any]) -> Policy:
    """The policy a ``conf/model`` node describes (``_target_`` plus its keyword arguments);
    how an engine or a remote trainer makes its own copy of the model from config."""
    from hydra.utils import instantiate

    policy = instantiate(dict(config))
    if not isinstance(policy, Policy):
        raise ConfigError(f"model._target_={config.get('_target_')} did not build a Policy")
    return policy
