"""Command line: ``python -m orchestrator experiment=<name> key=value …`` (``-m`` sweeps).

A thin ``@hydra.main`` around :func:`orchestrator.main.run`. Configuration mistakes (an
unknown experiment, key or value) end the process with one line naming what to change;
anything else is a bug and keeps its traceback.

``resume=<run_dir>`` continues that run from its latest valid checkpoint, in the same
directory, with the config it was started with: only keys that cannot change the maths may
be overridden (:data:`RESUMABLE`); any other override is refused in one line.
``resume=auto`` with ``hydra.run.dir=<run_dir>`` resumes when that directory has a
checkpoint and starts the run there otherwise (for a job scheduler that restarts a job).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator.errors import ConfigError, RunAborted, chain
from sandboxes.api import EngineUnavailable, ImageMissing, SandboxError

CONF = Path(__file__).resolve().parent.parent / "conf"


def register_plugins() -> None:
    """Environments from installed plug-in packages become ``env=<name>`` options."""
    from envs.registry import register_hydra_configs

    register_hydra_configs({p.stem for p in (CONF / "env").glob("*.yaml")})


# Keys a resumed run may change: how long it runs, what it logs, how it checkpoints, how many
# trainer ranks share the step (the same maths at any world size) and where they run.
RESUMABLE = ("pipeline.num_steps", "progress", "progress_every", "logger", "checkpoint",
             "trainer.world_size", "launcher")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _entry(cfg: DictConfig) -> float | None:
    return _run_and_report(cfg, Path(HydraConfig.get().runtime.output_dir))


def _run_and_report(cfg: DictConfig, run_dir: Path, resume_from: Path | None = None) -> float | None:
    from orchestrator.main import run

    try:
        result = run(cfg, run_dir, resume_from)
    except (ConfigError, RunAborted, InstantiationException, OmegaConfBaseException,
            BaseExceptionGroup) as error:
        # Exit from inside the job: Hydra would otherwise print its own line first.
        message = explain(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    s = result.summary
    if s:
        print(
            f"run_dir={result.run_dir} steps={s['steps']} "
            f"reward_first_10pct={s['reward_first_10pct']:.3f} "
            f"reward_last_10pct={s['reward_last_10pct']:.3f} "
            f"eval_before={s['eval_before']} eval_after={s['eval_after']} "
            f"dropped_stale={s['dropped_stale']} samples_per_s={s['samples_per_s']:.1f}"
        )
        return float(s["reward_last_10pct"])
    return None


def explain(error: BaseException) -> str | None:
    """One sentence for a configuration mistake, or None if ``error`` is not one."""
    for e in chain(error):  # the error behind a task group's crash, too
        if isinstance(e, (ConfigError, RunAborted, EngineUnavailable, ImageMissing)):  # not a bug
            return str(e)
        if isinstance(e, MissingMandatoryValue):
            key = getattr(e, "full_key", None) or "a required key"
            return f"{key} must be set, e.g. {key}=…"
    if isinstance(error, MissingConfigException):
        missing = re.search(r"Could not find '([^']+)/([^'/]+)'", str(error))
        options = re.findall(r"^\t(\S+)$", str(error), flags=re.M)
        if missing:
            group, name = missing.groups()
            listed = f"; available: {', '.join(options)}" if options else ""
            return f"unknown {group} '{name}'{listed}"
    if isinstance(error, InstantiationException):
        # A bad argument is the user's to fix; anything else (out of memory, a bug) is not.
        for e in chain[1:]:
            if isinstance(e, (ValueError, TypeError)):
                return f"{e}".splitlines()[0]
        return None
    text = str(error)
    override = re.search(r"Could not override '([^']+)'", text)
    if override:
        key = override.group(1)
        return f"unknown config key '{key}': check its spelling, or add a new key with +{key}=…"
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return " ".join(lines[:2]) if lines else type(error).__name__
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
    from orchestrator.checkpoint import CheckpointStore

    if CheckpointStore(Path(run_dir) / "checkpoints").latest_valid() is None:
        return None, True  # nothing to resume yet: a fresh run in that directory
    return Path(run_dir), True


def resumed_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """``run_dir``'s own config with ``overrides`` of :data:`RESUMABLE` keys applied."""
    import yaml
    from omegaconf import OmegaConf

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


def resume(run_dir: Path, overrides: list[str], auto: bool = False) -> None:
    from orchestrator.resume import find_checkpoint

    checkpoint = find_checkpoint(run_dir)
    cfg = same_command_config(run_dir, overrides) if auto else resumed_config(run_dir, overrides)
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(run_dir / "train.log")])
    logging.getLogger(__name__).info("resume=%s: from %s", run_dir, checkpoint)
    _run_and_report(cfg, run_dir, checkpoint)


def main() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach explain() instead of Hydra's printer
    register_plugins()
    try:
        args = sys.argv[1:]
        target, auto = resume_target(args)
        if target is not None:
            resume(target, args, auto)
            return
        sys.argv[1:] = args
        _entry()
    except (ConfigError, RunAborted, HydraException, OmegaConfBaseException, ValueError,
            TypeError, SandboxError, BaseExceptionGroup) as error:
        message = explain(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
