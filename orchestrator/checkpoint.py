"""Checkpoints: the policy in Hugging Face format plus the rest of the trainer's state.

``<dir>/model/`` is a ``save_pretrained`` directory (safetensors), loadable by
``model=hf model.path=<dir>/model`` when the tokenizer is a Hugging Face one; the character
tokenizer needs nothing saved. ``<dir>/trainer.pt`` holds the rest of
:meth:`TorchTrainer.state_dict`: optimiser, learning-rate schedule and version.
"""

from __future__ import annotations

from pathlib import Path

import torch

from orchestrator.errors import ConfigError
from orchestrator.trainer import TorchTrainer, Trainer


def save_checkpoint(trainer: Trainer, directory: Path) -> Path:
    """Write ``trainer``'s checkpoint (a :class:`TorchTrainer`'s: others have no model here)."""
    from transformers.utils import logging as hf_logging

    if not isinstance(trainer, TorchTrainer):
        raise ConfigError(f"cannot checkpoint a {type(trainer).__name__}: only a TorchTrainer "
                          f"has a model to save")
    hf_logging.disable_progress_bar()  # the run has its own progress display
    directory.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(directory / "model", safe_serialization=True)
    tokenizer = getattr(trainer.policy.tokenizer, "_tok", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory / "model")
    state = {k: v for k, v in trainer.state_dict().items() if k != "model"}
    torch.save(state, directory / "trainer.pt")
    return directory


def load_checkpoint(trainer: TorchTrainer, directory: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model" / "model.safetensors"))
    trainer.model.load_state_dict(weights, strict=False)  # tied weights are saved once
    state = torch.load(directory / "trainer.pt", weights_only=True)
    trainer.load_state_dict({**state, "model": trainer.model.state_dict()})
