"""Command line: ``python -m orchestrator experiment=<name> key=value …`` (``-m`` sweeps).

A thin ``@hydra.main`` around :func:`orchestrator.main.run`. Configuration mistakes (an
unknown experiment, key or value) end the process with one line naming what to change;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator.errors import ConfigError, RunAborted
from sandboxes.api import EngineUnavailable, ImageMissing, SandboxError

CONF = Path(__file__).resolve().parent.parent / "conf"


def register_plugins() -> None:
    """Environments from installed plug-in packages become ``env=<name>`` options."""
    from envs.registry import register_hydra_configs

    register_hydra_configs({p.stem for p in (CONF / "env").glob("*.yaml")})


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _entry(cfg: DictConfig) -> float | None:
    from orchestrator.main import run

    try:
        result = run(cfg, Path(HydraConfig.get().runtime.output_dir))
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
    chain: list[BaseException] = []
    todo: list[BaseException] = [error]
    while todo:  # causes, contexts, and the members of exception groups (task-group crashes)
        e = todo.pop(0)
        if e in chain:
            continue
        chain.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    for e in chain:
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


def main() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach explain() instead of Hydra's printer
    register_plugins()
    try:
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
