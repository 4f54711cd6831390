"""``python -m orchestrator.trace fit``: the replay engine's parameters from trace steps.

Fits :class:`~orchestrator.engines.replay_model.ServerParams` to the multi-turn workload
steps given (see :func:`orchestrator.engines.replay_model.fit`) and records what the trainer
cost model is calibrated from: the mean rollout makespan and token count of those steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orchestrator.engines.replay_model import episodes_from, fit
from orchestrator.engines.replay_run import EngineFit
from orchestrator.trace.reader import TraceDir


def fit_trace(trace_dir: Path | str, steps: Sequence[int] | None = None,
              iterations: int = 90, replicas: int = 1) -> EngineFit:
    """Fit on ``steps`` of ``trace_dir`` (all by default). ``replicas`` > 1 plays every
    trajectory that many times, to rebuild a full step's load from a sample of it."""
    trace = TraceDir.open(trace_dir)
    steps = list(steps) if steps is not None else trace.steps()
    records = {s: list(trace.workload(s)) for s in steps}
    episodes = [episodes_from(records[s]) for s in steps]
    params, loss = fit(episodes, iterations=iterations, replicas=replicas)
    return EngineFit(
        server=params,
        makespan_s=float(np.mean([max(r.end_to_end_s for r in records[s]) for s in steps])),
        tokens_per_step=float(np.mean([sum(r.final_total_len for r in records[s]) for s in steps])) * replicas,
        trajectories_per_step=float(np.mean([len(records[s]) for s in steps])) * replicas,
        source=str(trace.path), steps=tuple(steps), loss=loss,
    )
