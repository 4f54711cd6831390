"""``python -m orchestrator experiment=<name> key=value …`` runs :func:`orchestrator.builders.run`
(``resume=``: :mod:`orchestrator.run.resume`). A configuration mistake ends it with one line naming
what to change (:func:`orchestrator.config.read.explain`); a bug keeps its traceback."""

from orchestrator.allocator import keep_freed_memory

keep_freed_memory()  # before any other thread allocates (see orchestrator.allocator)

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from orchestrator.config.read import explain, register_plugin_envs  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _entry(cfg: DictConfig) -> float | None:
    return _run_and_report(cfg, Path(HydraConfig.get().runtime.output_dir))


# Third-party clients that log every request at INFO (an agent program's openai client makes
# one line per gateway call): kept at WARNING, so the run's own lines stay readable, unless
# their level is set (hydra.job_logging.loggers.<name>.level=INFO).
QUIET_LOGGERS = ("httpx", "httpcore", "openai", "urllib3", "filelock")


def _quiet_third_party() -> None:
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def _run_and_report(cfg: DictConfig, run_dir: Path, resume_from: Path | None = None) -> float | None:
    from orchestrator.builders import run

    _quiet_third_party()

    try:  # exit from inside the job: Hydra would otherwise print its own line first
        result = run(cfg, run_dir, resume_from)
    except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001 - re-raised unless explained
        _exit_if_explained(error)
    print(result.line())
    return result.final_reward


def _exit_if_explained(error: BaseException) -> NoReturn:
    message = explain(error)
    if message is None:
        raise error
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2) from None


def main() -> None:
    from orchestrator.run.resume import from_command_line

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach explain() instead of Hydra's printer
    register_plugin_envs()
    try:
        resumed = from_command_line(args := sys.argv[1:])
        if resumed is None:
            sys.argv[1:] = args
            _entry()
        elif resumed.finished is not None:
            print(resumed.finished_line())
        else:
            resumed.log_to_run_dir()
            _run_and_report(resumed.config, resumed.run_dir, resumed.checkpoint)
    except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001 - SystemExit passes
        _exit_if_explained(error)


if __name__ == "__main__":
    main()
