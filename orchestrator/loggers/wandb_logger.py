"""Weights & Biases logging that never prompts.

``mode=auto`` logs online only when an API key is configured and the W&B host answers
within a second; otherwise the run is written offline under ``<run_dir>/wandb`` (upload it
later with ``wandb sync``). ``mode`` may also be ``online``, ``offline`` or ``disabled``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.loggers.base import Logger, step_metrics
from orchestrator.types import Evaluation, StepReport

_MODES = ("auto", "online", "offline", "disabled")
EVAL_COLUMNS = ("when", "source", "task_id", "sample", "prompt", "completion", "reward", "answer",
                "reference")


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _reachable(host: str = "api.wandb.ai", port: int = 443, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class WandbLogger(Logger):
    def __init__(self, project: str = "polyrl", mode: str = "auto", name: str | None = None,
                 tags: list[str] | None = None) -> None:
        if mode not in _MODES:
            raise ConfigError(f"logger.mode={mode} must be one of {', '.join(_MODES)}")
        self.project = project
        self.mode = mode
        self.name = name
        self.tags = list(tags or [])
        self._run: Any = None

    def start(self, config: dict[str, Any], run_dir: Path) -> None:
        import wandb

        mode = self.mode
        if mode == "auto":
            mode = "online" if _has_api_key() and _reachable() else "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=self.project,
            name=self.name or run_dir.name,
            dir=str(run_dir),
            config=config,
            mode=mode,
            tags=self.tags,
            reinit="finish_previous",
            id=self.resume_id,
            resume="allow" if self.resume_id else None,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    @property
    def run_id(self) -> str | None:
        return self._run.id if self._run is not None else None

    def log_step(self, report: StepReport) -> None:
        import wandb

        metrics: dict[str, Any] = dict(step_metrics(report))
        metrics["staleness/histogram"] = wandb.Histogram(list(report.staleness))
        metrics["reward/histogram"] = wandb.Histogram(list(report.rewards))
        self._run.log(metrics, step=report.step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_evaluation(self, when: str, step: int, evaluation: Evaluation) -> None:
        """``eval/samples``: a table of the evaluation's few samples per source; before and
        after RL also its figures under the names a periodic evaluation's have (``eval/…``)."""
        import wandb

        table = wandb.Table(columns=list(EVAL_COLUMNS))
        for s in evaluation.examples:
            table.add_data(when, s.source, s.task_id, s.sample_index, s.prompt, s.completion,
                           s.reward, s.answer, s.reference)
        metrics: dict[str, Any] = {"eval/samples": table}
        if when != "during":
            metrics.update(evaluation.metrics("eval"))
            metrics["eval/accuracy"] = evaluation.mean
        self._run.log(metrics, step=step)

    def finish(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None
