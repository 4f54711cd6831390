"""Checkpoints: the policy in Hugging Face format plus the trainer's state.

``<dir>/model/`` is a ``save_pretrained`` directory (safetensors), loadable by
``model=hf model.path=<dir>/model`` when the tokenizer is a Hugging Face one; the character
tokenizer needs nothing saved. ``<dir>/trainer.pt`` holds the optimiser state and version.
"""

from __future__ import annotations

from pathlib import Path

import torch

from orchestrator.trainer import Trainer


def save_checkpoint(trainer: Trainer, directory: Path) -> Path:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run has its own progress display
    directory.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(directory / "model", safe_serialization=True)
    tokenizer = getattr(trainer.policy.tokenizer, "_tok", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory / "model")
    torch.save(
        {"version": trainer.version, "optimizer": trainer.optimizer.state_dict()},
        directory / "trainer.pt",
    )
    return directory


def load_checkpoint(trainer: Trainer, directory: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model" / "model.safetensors"))
    trainer.model.load_state_dict(weights, strict=False)
    state = torch.load(directory / "trainer.pt", weights_only=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.version = int(state["version"])
