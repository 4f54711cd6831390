"""A trainer's checkpoint state, copied off its live tensors so training may go on while it
is written.

A checkpoint directory of a :class:`~orchestrator.trainer.TorchTrainer` holds:

* ``model/``: a ``save_pretrained`` directory (safetensors), loadable by
  ``model=hf model.path=<dir>/model`` when the tokenizer is a Hugging Face one;
* ``trainer.pt``: the rest of :meth:`TorchTrainer.state_dict` (optimiser, learning-rate
  schedule and its warm-up position, version).

A group of trainer ranks writes shards instead (:mod:`orchestrator.trainer.distributed`),
which :func:`load_shards` reads at any world size, one process included.
The run's periodic checkpoints add their own files beside these
(:mod:`orchestrator.run.checkpoint`, :mod:`orchestrator.run.resume`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from orchestrator.errors import ConfigError
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.weights.update import as_bytes_array, from_bytes_array


class Trained(Protocol):
    """What a checkpoint reads and restores of a trainer (a :class:`TorchTrainer`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    version: int

WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer.pt"  # the rest of the state (a group of ranks: rank 0's, beside its shards)
SHARDS = "shards"  # a group of trainer ranks' torch.distributed.checkpoint directory


@dataclass
class TrainerSnapshot:
    """A trainer's checkpoint, copied off its live tensors (:meth:`capture`), so training may
    go on while it is written (:meth:`write`, in a worker thread). It is self-contained and
    picklable: a trainer in a Ray actor hands it to the driver, which writes it in the run
    directory, and a checkpoint read back (:meth:`read`) is shipped the other way to be
    loaded (:meth:`TorchTrainer.restore`) wherever the trainer lives."""

    weights: dict[str, torch.Tensor]  # the model's, tied ones once (the first name kept)
    state: dict[str, Any]  # the rest of the trainer's state_dict: optimiser, schedule, version
    config: Any = None  # the model's PretrainedConfig (None: read back, not written again)
    generation_config: Any = None
    tokenizer: Tokenizer | None = None  # saved beside the model (a Hugging Face one's files)
    borrowed: bool = False  # unpickled: its tensors may be read-only object store memory

    @classmethod
    def capture(cls, state: Mapping[str, Any], model: torch.nn.Module, tokenizer: Tokenizer,
                into: TrainerSnapshot | None = None) -> TrainerSnapshot:
        """Copy a trainer's ``state`` (its state_dict) and ``model``'s config; into the tensors
        of ``into`` (a snapshot already written, so no longer read) where they fit: copying
        into memory already mapped takes less than half the time of fresh allocations, and
        the trainer waits for this part."""
        state = dict(state)
        with torch.no_grad():
            weights = _copy_into(_untied(state.pop("model")), into.weights if into else None)
            rest = _copy_into(state, into.state if into else None)
        return cls(weights=weights, state=rest, config=model.config,
                   generation_config=getattr(model, "generation_config", None),
                   tokenizer=tokenizer)

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
            self.tokenizer.save_pretrained(model_dir)  # nothing for the character tokenizer
        torch.save(self.state, directory / TRAINER_STATE)
        return directory

    @classmethod
    def read(cls, directory: Path) -> TrainerSnapshot:
        from safetensors.torch import load_file

        return cls(weights=load_file(str(directory / "model" / WEIGHTS)),
                   state=torch.load(directory / TRAINER_STATE, weights_only=True))

    # Pickled (into Ray's object store, say), tensors travel as numpy byte arrays: protocol 5
    # hands those out of band, without a copy, where a tensor pickles through torch.save into
    # bytes. That way SmolLM2-135M's 1.5 GB snapshot (weights and Adam) took 20 s in a trainer
    # actor and grew it to 11 GB, enough for Ray's memory monitor to kill it.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "weights": _as_arrays(self.weights),
                "state": _as_arrays(self.state)}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__dict__.update(pickled, weights=_as_tensors(pickled["weights"]),
                             state=_as_tensors(pickled["state"]), borrowed=True)

    def owned_state(self) -> dict[str, Any]:
        """:attr:`state` in memory of its own, safe to train on (a restored optimiser writes
        into its state's tensors); only a :attr:`borrowed` one is copied."""
        return _copy_into(self.state, None) if self.borrowed else self.state


class _Array(NamedTuple):
    """A pickled snapshot's tensor (:func:`~orchestrator.weights.update.as_bytes_array`)."""

    dtype: str
    shape: tuple[int, ...]
    data: Any  # a uint8 numpy array


def _as_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Array(*as_bytes_array(value))
    if isinstance(value, Mapping):
        return {k: _as_arrays(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # a named tuple is pickled as it is
        return type(value)(_as_arrays(v) for v in value)
    return value


def _as_tensors(value: Any) -> Any:
    """:func:`_as_arrays` undone, over the arrays' memory (read-only, when it is the object
    store's: a snapshot is written from it, and :meth:`TrainerSnapshot.owned_state` copies
    what a trainer restores)."""
    if isinstance(value, _Array):
        return from_bytes_array(*value)
    if isinstance(value, Mapping):
        return {k: _as_tensors(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_as_tensors(v) for v in value)
    return value


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


def load_shards(trainer: Trained, directory: Path) -> None:
    """Load a sharded checkpoint (:meth:`RankTrainer.save`, any world size) into ``trainer``: a
    rank of a group (every rank calls it), or the one in-process trainer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    directory = Path(directory)
    if not (directory / SHARDS).is_dir():
        raise ConfigError(f"{directory} holds no {SHARDS}/ (a checkpoint of a run with "
                          f"trainer.world_size unset): resume it with trainer.world_size unset")
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    reference = getattr(trainer, "_reference_model", None)
    saved = dcp.FileSystemReader(str(directory / SHARDS)).read_metadata().state_dict_metadata
    if reference is not None and any(k.startswith("reference.") for k in saved):
        state["reference"] = get_model_state_dict(reference)
    with warnings.catch_warnings():  # one process, no group: what is meant, said as a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        dcp.load(state, checkpoint_id=str(directory / SHARDS), no_dist=not dist.is_initialized())
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    if "reference" in state:
        set_model_state_dict(reference, state["reference"])
        trainer._reference_started = True
    rest = torch.load(directory / TRAINER_STATE, weights_only=True)
    trainer.scheduler.load_state_dict(rest["scheduler"])
    trainer.version = int(rest["version"])
