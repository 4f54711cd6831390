"""What a command's TARGET (``orchestrator.commands.eval``) or SOURCE
(``orchestrator.commands.export``) names, and the model a checkpoint holds.

Three kinds of directory:

* a **run directory** (``config.yaml`` and ``checkpoints/``): its latest checkpoint, the more
  recently written of ``final`` (which a run writes when it ends) and its newest valid
  ``step-N``; a ``step`` picks ``checkpoints/step-N``, and ``step="best"`` the best one
  (``checkpoint.keep_best``, named in ``checkpoints/best.json``);
* a **checkpoint directory** of a run (``<run_dir>/checkpoints/step-N`` or ``final``), which
  the run's own ``config.yaml`` two levels up describes;
* a **Hugging Face model directory** (``config.json``: one ``orchestrator.commands.export`` wrote,
  or any ``save_pretrained`` directory), which only ``orchestrator.commands.eval`` takes.

:func:`load` builds the run's model from the ``model`` node of its ``config.yaml`` (on the
CPU), wraps it with the run's LoRA adapters if it had them, and loads the checkpoint into it
as a resumed trainer loads it: one process's ``model/model.safetensors`` (tied weights saved
once), or trainer ranks' ``shards/`` read at world size one, which gathers them to full
tensors (the optimiser's state is not read). The weights keep the dtype the checkpoint holds
them in.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from orchestrator.errors import ConfigError
from orchestrator.models.policy import Policy, build_policy
from orchestrator.run.checkpoint import MANIFEST, CheckpointStore, CorruptCheckpoint, verify
from orchestrator.trainer.lora import LoraConfig
from orchestrator.trainer.snapshot import SHARDS, TRAINER_STATE, WEIGHTS

CONFIG = "config.yaml"  # the run's resolved config, written by RunDir
Step = int | Literal["best"] | None  # a run directory's checkpoint: the latest (None), N, best


def parse_step(text: str) -> int | Literal["best"]:
    """``--step``'s value: a step number or ``best``."""
    if text == "best":
        return "best"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--step {text} must be a step number or best") from None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint and the run it belongs to."""

    path: Path
    run_dir: Path

    @property
    def sharded(self) -> bool:
        """Whether the weights are trainer ranks' shards; where a ``final`` holds both (a run
        resumed at another world size wrote it again), the newer ones."""
        shards, weights = self.path / SHARDS / ".metadata", self.path / "model" / WEIGHTS
        if not weights.is_file() or not shards.is_file():
            return shards.is_file()
        return shards.stat().st_mtime > weights.stat().st_mtime

    @property
    def name(self) -> str:
        """``step-N`` or ``final``."""
        return self.path.name


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / "checkpoints").is_dir()


def is_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() and (
        (path / "model" / WEIGHTS).is_file() or (path / SHARDS).is_dir())


def is_model_dir(path: Path) -> bool:
    """A Hugging Face model directory (``config.json``), not a run's checkpoint."""
    return (path / "config.json").is_file() and not is_checkpoint(path)


def locate(source: str | Path, step: Step = None) -> Checkpoint:
    """The checkpoint ``source`` names (a run directory, with ``step`` one of its periodic
    checkpoints or ``best``; or a checkpoint directory of a run); one line if it names none."""
    path = Path(source)
    if is_run_dir(path):
        return Checkpoint(_in_run(path, step), path)
    if is_checkpoint(path):
        if step is not None:
            raise ConfigError(f"--step {step} picks a checkpoint of a run directory, but {path} "
                              "is a checkpoint directory already: drop --step or give the run")
        run_dir = path.parent.parent
        if path.parent.name != "checkpoints" or not (run_dir / CONFIG).is_file():
            raise ConfigError(f"{path} is a checkpoint outside its run directory (no "
                              f"../../{CONFIG}), which says what model it holds: use it from "
                              "<run_dir>/checkpoints/ where the run wrote it")
        return Checkpoint(path, run_dir)
    if (path / CONFIG).is_file():
        raise ConfigError(f"{path} is a run directory with no checkpoints/ (the run was started "
                          "with no checkpoint.every or every_s, or ended before its first one)")
    raise ConfigError(f"{path} is neither a run directory (with {CONFIG} and checkpoints/) nor "
                      "a checkpoint directory (<run_dir>/checkpoints/step-N or final)")


def _in_run(run_dir: Path, step: Step) -> Path:
    store = CheckpointStore(run_dir / "checkpoints")
    if step == "best":
        best = store.best()
        if best is None:
            raise ConfigError(f"--step best: {run_dir} has no best checkpoint (start the run with "
                              "checkpoint.keep_best=<metric>; one is named once an evaluation "
                              "has scored a checkpoint)")
        return store.path(best.step)
    if step is not None:
        if step not in store.steps():
            have = ", ".join(map(str, store.steps())) or "none"
            raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of step {step} "
                              f"(its steps: {have})")
        return store.path(step)
    found = [p for p in (store.latest_valid(), run_dir / "checkpoints" / "final")
             if p is not None and is_checkpoint(p)]
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint")
    # final, when it is the newest step's files linked (checkpointer.save_final), is named
    return max(found, key=lambda p: ((p / TRAINER_STATE).stat().st_mtime, p.name == "final"))


def step_of(checkpoint: Checkpoint) -> int | None:
    """The steps trained before ``checkpoint`` (``step-N``: N); None for ``final``."""
    name = checkpoint.name
    return int(name.removeprefix("step-")) if name.startswith("step-") else None


def run_config(run_dir: Path) -> tuple[dict[str, Any], LoraConfig | None]:
    """The ``model`` node of the run's config (on the CPU) and its LoRA, if any."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.load(run_dir / CONFIG)
    assert isinstance(cfg, DictConfig)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if not isinstance(model, dict):
        raise ConfigError(f"{run_dir / CONFIG} has no model node")
    model = {str(k): v for k, v in model.items()}
    if "device" in model:
        model["device"] = "cpu"
    lora = OmegaConf.select(cfg, "trainer.lora")
    return model, LoraConfig.of(OmegaConf.to_container(lora) if lora is not None else None)  # type: ignore[arg-type]


def load(checkpoint: Checkpoint) -> tuple[Policy, torch.nn.Module, LoraConfig | None]:
    """The run's policy and the model holding ``checkpoint``'s weights (``peft``-wrapped for a
    LoRA run)."""
    if (checkpoint.path / MANIFEST).is_file():
        try:
            verify(checkpoint.path)
        except CorruptCheckpoint as e:
            raise ConfigError(f"{checkpoint.path} is damaged: {e}") from None
    node, lora = run_config(checkpoint.run_dir)
    policy = build_policy(node)
    model = policy.model
    if lora is not None:
        model = lora.wrap(model)
    if checkpoint.sharded:
        _load_shards(model, checkpoint.path / SHARDS)
    else:
        _load_weights(model, checkpoint.path / "model" / WEIGHTS)
    return policy, model.eval(), lora


def _load_weights(model: torch.nn.Module, file: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(file))
    model.to(_stored_dtype(w.dtype for w in weights.values()))
    result = model.load_state_dict(weights, strict=False)
    tied = _tied_names(model)  # saved once, under the first name
    missing = [n for n in result.missing_keys if n not in tied]
    if result.unexpected_keys or missing:
        raise ConfigError(f"{file} does not hold the run's model: "
                          f"{len(missing)} of its weights missing ({', '.join(missing[:3])}), "
                          f"{len(result.unexpected_keys)} unknown "
                          f"({', '.join(result.unexpected_keys[:3])})")


def _load_shards(model: torch.nn.Module, shards: Path) -> None:
    """The model's full tensors from every rank's shards (the optimiser's are left unread)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    metadata = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    model.to(_stored_dtype(getattr(getattr(m, "properties", None), "dtype", None)
                           for name, m in metadata.items() if name.startswith("model.")))
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # one process, no group: what is meant, said as a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        dcp.load(state, checkpoint_id=str(shards), no_dist=True)
    set_model_state_dict(model, state["model"])


def _stored_dtype(dtypes: Any) -> torch.dtype:
    """The floating dtype the checkpoint holds the weights in (float32 if none is)."""
    return next((d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point),
                torch.float32)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names of tensors sharing another's storage (a tied LM head): saved once, by its first
    name."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tied.add(name)
        seen.add(ptr)
    return tied
