"""Checkpoints: the trainer's state, and the run's periodic, atomic checkpoints to resume from.

One checkpoint directory holds:

* ``model/``: a ``save_pretrained`` directory (safetensors), loadable by
  ``model=hf model.path=<dir>/model`` when the tokenizer is a Hugging Face one;
* ``trainer.pt``: the rest of :meth:`TorchTrainer.state_dict` (optimiser, learning-rate
  schedule and its warm-up position, version);
* in a run's periodic checkpoints, ``run_state.json`` and ``rng.pt`` too (see
  :mod:`orchestrator.resume`);
* ``MANIFEST.json``, written last: every other file with its size and SHA-256.

A checkpoint is taken in two parts so that the trainer waits only for the first: a
:class:`TrainerSnapshot` copies the trainer's tensors (:meth:`TrainerSnapshot.capture`), and
its :meth:`~TrainerSnapshot.write` writes them while training goes on. A snapshot is picklable
and self-contained: a trainer in a Ray actor hands its snapshot to the driver, which writes
it into the run directory, so every checkpoint lies beside the run's other files, whichever
node the trainer ran on.

:class:`CheckpointStore` writes ``<run_dir>/checkpoints/step-<N>/`` atomically: into a
temporary directory, every file fsynced, the manifest last, then renamed into place. A
directory without a manifest (a crash mid-write) is never loaded, and one whose files do not
match their manifest is reported in one line and skipped for the previous one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from orchestrator.errors import ConfigError, PolyRLError
from orchestrator.faults import kill_point
from orchestrator.trainer import TorchTrainer, Trainer

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class Snapshot(Protocol):
    """A trainer's checkpoint state taken at one moment, written later (in a worker thread)."""

    def write(self, directory: Path) -> Any:
        """Write the trainer's files (``model/``, ``trainer.pt``) into ``directory``."""


@dataclass
class TrainerSnapshot:
    """A trainer's checkpoint, copied off its live tensors (:meth:`capture`), so training may
    go on while it is written (:meth:`write`, in a worker thread). It is self-contained and
    picklable: a trainer in a Ray actor hands it to the driver, which writes it in the run
    directory, and a checkpoint read back (:meth:`read`) is shipped the other way to be
    loaded (:meth:`restore`) wherever the trainer lives."""

    weights: dict[str, torch.Tensor]  # the model's, tied ones once (the first name kept)
    state: dict[str, Any]  # the rest of the trainer's state_dict: optimiser, schedule, version
    config: Any = None  # the model's PretrainedConfig (None: read back, not written again)
    generation_config: Any = None
    tokenizer: Any = None  # a Hugging Face tokenizer, saved beside the model

    @classmethod
    def capture(cls, trainer: Trainer, into: TrainerSnapshot | None = None) -> TrainerSnapshot:
        """Copy ``trainer``'s state; into the tensors of ``into`` (a snapshot already written,
        so no longer read) where they fit: copying into memory already mapped takes less than
        half the time of fresh allocations, and the trainer waits for this part."""
        if not isinstance(trainer, TorchTrainer):
            raise ConfigError(f"cannot checkpoint a {type(trainer).__name__}: only a TorchTrainer "
                              f"has a model to save")
        state = dict(trainer.state_dict())
        model = trainer.model
        with torch.no_grad():
            weights = _copy_into(_untied(state.pop("model")), into.weights if into else None)
            rest = _copy_into(state, into.state if into else None)
        return cls(weights=weights, state=rest, config=model.config,
                   generation_config=getattr(model, "generation_config", None),
                   tokenizer=getattr(trainer.policy.tokenizer, "_tok", None))

    def write(self, directory: Path) -> Path:
        from safetensors.torch import save_file

        model_dir = directory / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        if self.config is not None:
            self.config.save_pretrained(model_dir)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(model_dir)
        save_file(self.weights, str(model_dir / WEIGHTS), metadata={"format": "pt"})
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(model_dir)
        torch.save(self.state, directory / TRAINER_STATE)
        return directory

    @classmethod
    def read(cls, directory: Path) -> TrainerSnapshot:
        from safetensors.torch import load_file

        return cls(weights=load_file(str(directory / "model" / WEIGHTS)),
                   state=torch.load(directory / TRAINER_STATE, weights_only=True))

    def restore(self, trainer: TorchTrainer) -> None:
        trainer.model.load_state_dict(self.weights, strict=False)  # tied weights are saved once
        trainer.load_state_dict({**self.state, "model": trainer.model.state_dict()})


def save_checkpoint(trainer: Trainer, directory: Path) -> Path:
    """Write ``trainer``'s checkpoint (a :class:`TorchTrainer`'s: others have no model here)."""
    return TrainerSnapshot.capture(trainer).write(directory)


def load_checkpoint(trainer: TorchTrainer, directory: Path) -> None:
    TrainerSnapshot.read(directory).restore(trainer)


def _untied(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without a tensor sharing another's storage (a tied LM head), as
    ``save_pretrained`` leaves it out."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out[name] = tensor
    return out


def _copy_into(value: Any, old: Any) -> Any:
    """A CPU copy of ``value`` (a tree of dicts, lists and tensors), reusing ``old``'s tensors
    of the same shape and dtype."""
    if isinstance(value, torch.Tensor):
        if (isinstance(old, torch.Tensor) and old.shape == value.shape
                and old.dtype == value.dtype and old.device.type == "cpu"):
            return old.copy_(value)
        return value.detach().to("cpu", copy=True).contiguous()
    if isinstance(value, Mapping):
        olds = old if isinstance(old, Mapping) else {}
        return {k: _copy_into(v, olds.get(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        olds = list(old) if isinstance(old, list | tuple) and len(old) == len(value) else []
        copied = [_copy_into(v, olds[i] if olds else None) for i, v in enumerate(value)]
        return copied if isinstance(value, list) else tuple(copied)
    return copy.deepcopy(value)


class CorruptCheckpoint(PolyRLError):
    """A checkpoint directory whose files do not match its manifest."""


class CheckpointStore:
    """``<run_dir>/checkpoints/step-<N>/``: written atomically, the last ``keep`` kept."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """``write(tmp_dir)`` fills a temporary directory; it becomes ``step-<step>`` once every
        file is on disk and the manifest, written last, lists them."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        kill_point("checkpoint", step)
        files = {str(p.relative_to(tmp)): _describe(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        for name in files:
            _fsync(tmp / name)
        _write_synced(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
        final = self.path(step)
        if final.exists():  # a resumed run writing the same step again
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(self.root)  # the rename itself is durable once the directory is synced
        self._prune()
        return final

    def steps(self) -> list[int]:
        """Steps with a complete (manifested) checkpoint directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = [int(m.group(1)) for p in self.root.iterdir()
                 if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
        return sorted(found)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint whose files match its manifest; corrupt ones are reported in
        one line each and skipped."""
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                verify(path)
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return path
        return None

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)


def verify(path: Path) -> None:
    """Raise :class:`CorruptCheckpoint` unless every file matches ``path``'s manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"unreadable {MANIFEST} ({e})") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CorruptCheckpoint(
                f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}")
        if _sha256(file) != expected["sha256"]:
            raise CorruptCheckpoint(f"{name} does not match its checksum")


def _describe(path: Path) -> dict[str, object]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
