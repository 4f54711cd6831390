"""What a run needs to continue after a crash, beyond the trainer's checkpoint.

A periodic checkpoint (:class:`~orchestrator.checkpoint.CheckpointStore`) taken at the end
of train step ``N`` holds the trainer (model, optimiser, schedule, version) plus:

* ``run_state.json`` (:class:`RunState`): the next step, the policy version, the task
  sampler (its shuffle state, the rest of the current pass, and every prompt handed out but
  not yet trained: they are handed out again first), the count of samples dropped as stale,
  the warm start and first evaluation already done, and the W&B run id;
* ``rng.pt``: the python, numpy and torch random states.

Not saved: episodes in flight and groups generated but not yet trained. Their prompts go back
to the sampler and are rolled out again under the restored weights. Admission control
restarts from the restored version, so its capacity is ``(k + 1) × B`` ahead of it, never
more (the rule of :mod:`orchestrator.staleness`).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestrator.checkpoint import CheckpointStore
from orchestrator.errors import ConfigError

RUN_STATE = "run_state.json"
RNG = "rng.pt"


@dataclass
class RunState:
    step: int  # the next step to train (steps 0 .. step - 1 are done)
    version: int
    sampler: dict[str, Any]
    dropped: int = 0
    warm_start_steps: int = 0
    eval_before: float | None = None
    logger_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self, directory: Path, rng: dict[str, Any]) -> None:
        """``run_state.json``, and ``rng.pt`` from ``rng`` (:func:`capture_rng`)."""
        (directory / RUN_STATE).write_text(json.dumps(asdict(self)) + "\n")
        torch.save(rng, directory / RNG)

    @classmethod
    def read(cls, directory: Path) -> RunState:
        return cls(**json.loads((directory / RUN_STATE).read_text()))


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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_checkpoint(run_dir: Path) -> Path:
    """The latest valid periodic checkpoint of ``run_dir``; one line if there is none."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"resume={run_dir} is not a run directory (it has no config.yaml)")
    found = CheckpointStore(run_dir / "checkpoints").latest_valid()
    if found is None:
        raise ConfigError(f"resume={run_dir}: the run directory has no complete checkpoint to "
                          "resume from")
    return found


def truncate_after(run_dir: Path, step: int) -> None:
    """Make ``run_dir``'s records end where the checkpoint at ``step`` does, so the resumed
    run appends steps ``step, step + 1, …`` with no repeat: lines of later steps (and a
    finished run's summary line) leave ``metrics.jsonl`` and ``samples.jsonl``, and later
    steps' PolyTrace records are removed (:func:`~orchestrator.trace.writer.drop_steps_from`).
    A line cut short by a crash is dropped too."""
    from orchestrator.trace.writer import drop_steps_from

    for name, keep in (("metrics.jsonl", _metrics_line_kept), ("samples.jsonl", _sample_line_kept)):
        path = run_dir / name
        if path.is_file():
            lines = [line for line in path.read_text().splitlines() if keep(line, step)]
            path.write_text("".join(line + "\n" for line in lines))
    drop_steps_from(run_dir, step)


def steps_before(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` records of steps ``0 .. step - 1`` (a resumed run's summary
    covers them too)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [_parse(line) for line in path.read_text().splitlines()]
    return [r for r in records if r is not None and _metrics_line_kept_record(r, step)]


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _metrics_line_kept(line: str, step: int) -> bool:
    record = _parse(line)
    return record is not None and _metrics_line_kept_record(record, step)


def _metrics_line_kept_record(record: dict[str, Any], step: int) -> bool:
    return record.get("step", step) < step and not any(k.startswith("summary/") for k in record)


def _sample_line_kept(line: str, step: int) -> bool:
    record = _parse(line)
    return record is not None and record.get("step", step) < step
