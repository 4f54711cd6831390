"""Resuming a run: what its checkpoints hold beyond the trainer's files, and the command line's
``resume=``.

A periodic checkpoint (:class:`~orchestrator.run.checkpoint.CheckpointStore`) taken at the end of
train step ``N`` holds the trainer's own files (:meth:`Trainer.snapshot`) plus:

* ``run_state.json`` (:class:`RunState`): the pipeline's own state
  (:meth:`Pipeline.state_dict`: the next step, the count of samples dropped as stale, the task
  sampler with every prompt handed out but not yet trained, which are handed out again
  first), the policy version, the warm start and first evaluation already done, the W&B
  run id and the best checkpoint so far (``checkpoint.keep_best``, :mod:`orchestrator.run.best`);
* ``rng.pt``: the python, numpy and torch random states.

Not saved: episodes in flight and groups generated but not yet trained. Their prompts go back
to the sampler and are rolled out again under the restored weights. Admission control
restarts from the restored version (:mod:`orchestrator.staleness`), so no sample is more
than ``k`` versions old after a resume either.

Who restores what: :func:`restore` loads the trainer (wherever it lives) and the random
states and reads the run state; the run loop hands the pipeline its part, and the run
directory (:class:`~orchestrator.run.directory.RunDir`) cuts its records back to the checkpoint's
step.

On the command line, ``resume=<run_dir>`` continues that run from its latest valid
checkpoint, in the same directory, with the config it was started with: only keys that
cannot change the maths may be overridden (:data:`RESUMABLE`); any other override is refused
in one line. ``resume=auto`` with ``hydra.run.dir=<run_dir>`` resumes when that directory has
a checkpoint and starts the run there otherwise (for a job scheduler that restarts a job):
:func:`from_command_line`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from orchestrator.config.read import CONF
from orchestrator.errors import ConfigError
from orchestrator.run.checkpoint import MANIFEST, Best, CheckpointStore
from orchestrator.types import Evaluation

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from orchestrator.trainer.base import Trainer

log = logging.getLogger(__name__)

RUN_STATE = "run_state.json"
RNG = "rng.pt"


@dataclass
class RunState:
    pipeline: dict[str, Any]  # Pipeline.state_dict(): the next step, dropped count, sampler
    version: int
    warm_start_steps: int = 0
    eval_before: Evaluation | None = None  # the evaluation before RL (not run again)
    logger_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    best: Best | None = None  # checkpoint.keep_best's best checkpoint so far

    def write(self, directory: Path, rng: dict[str, Any]) -> None:
        """``run_state.json``, and ``rng.pt`` from ``rng`` (:func:`capture_rng`)."""
        state = {**asdict(self), "eval_before": None if self.eval_before is None
                 else self.eval_before.to_dict()}
        (directory / RUN_STATE).write_text(json.dumps(state) + "\n")
        torch.save(rng, directory / RNG)

    @property
    def step(self) -> int:
        """The next step to train (steps 0 .. step - 1 are done)."""
        return int(self.pipeline["step"])

    @classmethod
    def read(cls, directory: Path) -> RunState:
        state = json.loads((directory / RUN_STATE).read_text())
        if state.get("eval_before") is not None:
            state["eval_before"] = Evaluation.from_dict(state["eval_before"])
        state["best"] = Best.of(state.get("best"))
        return cls(**state)


def link_trainer_files(checkpoint: Path, directory: Path) -> Path:
    """``directory`` made to hold ``checkpoint``'s trainer files (all but the run's state and
    the manifest) as hard links (copies where the file system has none); returns it."""
    run_files = {RUN_STATE, RNG, MANIFEST}
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in sorted(checkpoint.rglob("*")):
        name = path.relative_to(checkpoint)
        if not path.is_file() or str(name) in run_files:
            continue
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, tmp / name)
        except OSError:
            shutil.copy2(path, tmp / name)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def restore(trainer: Trainer, checkpoint: Path) -> RunState:
    """Load ``checkpoint`` into ``trainer`` and this process's random states; the run state
    for the rest of the run to take its parts from."""
    trainer.load(checkpoint)
    state = RunState.read(checkpoint)
    restore_rng(checkpoint)
    log.info("resuming at step %d (version %d) from %s", state.step, state.version, checkpoint)
    return state


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys).copy()), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(directory: Path) -> None:
    state = torch.load(directory / RNG, weights_only=True)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # as many GPUs as both runs have
        for index, generator in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(generator, index)


def find_checkpoint(run_dir: Path) -> Path:
    """The latest valid periodic checkpoint of ``run_dir``; one line if there is none."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"resume={run_dir} is not a run directory (it has no config.yaml)")
    found = CheckpointStore(run_dir / "checkpoints").latest_valid()
    if found is None:
        raise ConfigError(f"resume={run_dir}: the run directory has no complete checkpoint to "
                          f"resume from (it stopped before its first); to start it again there, "
                          f"run the same command with resume=auto hydra.run.dir={run_dir}")
    return found


# -- the command line's resume= ------------------------------------------------------------

# Keys a resumed run may change: how long it runs, what it logs, how it checkpoints, how many
# trainer ranks share the step (the same maths at any world size) and where they run.
RESUMABLE = ("pipeline.num_steps", "progress", "progress_every", "logger", "checkpoint",
             "trainer.world_size", "launcher")


@dataclass(frozen=True)
class Resumed:
    """A run to go on with: its config, its directory and the checkpoint to start from.
    ``finished``: the run already ran its ``pipeline.num_steps`` (that many steps): there is
    nothing to train, unless the resume asks for more steps."""

    config: DictConfig
    run_dir: Path
    checkpoint: Path
    finished: int | None = None

    def finished_line(self) -> str:
        """What ``resume=`` of a finished run says (it trains nothing and exits 0)."""
        assert self.finished is not None
        return (f"resume={self.run_dir}: the run finished at step {self.finished} (its model: "
                f"{self.run_dir / 'checkpoints' / 'final'}); nothing to train. To train it "
                f"further, resume with more steps, e.g. pipeline.num_steps={2 * self.finished}")

    def log_to_run_dir(self) -> None:
        """Log as a fresh run does (Hydra sets that up for those), into the run's ``train.log``."""
        logging.basicConfig(
            level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
            handlers=[logging.StreamHandler(), logging.FileHandler(self.run_dir / "train.log")])
        log.info("resume=%s: from %s", self.run_dir, self.checkpoint)


def from_command_line(args: list[str]) -> Resumed | None:
    """The run that ``resume=`` in ``args`` asks to go on with, or None for a fresh run (then
    ``resume=auto`` is taken out of ``args``: a fresh run in ``hydra.run.dir``)."""
    target, auto = resume_target(args)
    if target is None:
        return None
    checkpoint = find_checkpoint(target)
    cfg = same_command_config(target, args) if auto else resumed_config(target, args)
    done = finished_steps(target)
    if done is not None and done >= int(cfg.pipeline.num_steps):
        return Resumed(cfg, target, checkpoint, finished=done)
    return Resumed(cfg, target, checkpoint)


def finished_steps(run_dir: Path) -> int | None:
    """The steps of ``run_dir`` if it finished (its ``checkpoints/final`` and ``summary.json``
    written), else None. A finished run resumed with a larger ``pipeline.num_steps`` goes on
    from its last step's checkpoint (written as every run ends); a crash in that continuation
    leaves a summary of fewer steps than the config, so resuming it goes on again."""
    summary = run_dir / "summary.json"
    if not (run_dir / "checkpoints" / "final").is_dir() or not summary.is_file():
        return None
    try:
        return int(json.loads(summary.read_text())["steps"])
    except (ValueError, KeyError, TypeError):
        return None


def resume_target(args: list[str]) -> tuple[Path | None, bool]:
    """The run directory ``resume=`` names (``auto``: ``hydra.run.dir`` when it holds a
    checkpoint) and whether it came from ``resume=auto``; (None, …) for a fresh run."""
    value = next((a.split("=", 1)[1] for a in args if a.startswith("resume=")), None)
    if value in (None, "null"):
        return None, False
    if value != "auto":
        return Path(value), False
    args.remove("resume=auto")
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), None)
    if run_dir is None:
        raise ConfigError("resume=auto needs the run directory: add hydra.run.dir=<run_dir>")
    if CheckpointStore(Path(run_dir) / "checkpoints").latest_valid() is None:
        return None, True  # nothing to resume yet: a fresh run in that directory
    return Path(run_dir), True


def resumed_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """``run_dir``'s own config with ``overrides`` of :data:`RESUMABLE` keys applied."""
    import yaml
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert isinstance(cfg, DictConfig)
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "resume" or key.startswith("hydra."):
            continue
        if not _resumable(key):
            raise ConfigError(
                f"{key} cannot change when resuming (the run's maths depend on it); only "
                f"{', '.join(RESUMABLE)} can: start a new run to change it")
        if key == "logger":  # a config group: its option's file
            cfg.logger = OmegaConf.load(CONF / "logger" / f"{value}.yaml")
        else:
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)  # typed as YAML
    return cfg


def same_command_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """``resume=auto``: the command line is the one that started the run, so it is composed
    as it was then and must give the run's config again, but for :data:`RESUMABLE` keys."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    saved = OmegaConf.load(run_dir / "config.yaml")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        now = compose("config", overrides=[o for o in overrides if not o.startswith("hydra.")])
    now_flat = _flat(OmegaConf.to_container(now, resolve=True))
    changed = [k for k, v in _flat(OmegaConf.to_container(saved)).items()
               if now_flat.get(k) != v and not _resumable(k)]
    if changed:
        raise ConfigError(f"{changed[0]} differs from the run being resumed in {run_dir} (the "
                          f"run's maths depend on it); only {', '.join(RESUMABLE)} can change")
    return now


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE)


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}
