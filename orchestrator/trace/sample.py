"""Cut a small sample out of a PolyTrace directory (how the shipped sample was made).

Multi-turn workloads keep whole prompt groups, evenly spaced over each step, so a sampled
step still has every group size and the long tail of its parent; packed lengths and reward
timings keep the first records of the first steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.trace.reader import TraceDir, step_file


def write_sample(source: Path, target: Path, groups_per_step: int = 8, steps: int = 4,
                 rows: int = 8) -> int:
    """Write the sample of ``source`` into ``target``; returns the number of records."""
    trace = TraceDir.open(source)
    target.mkdir(parents=True, exist_ok=True)
    written = 0
    for step in trace.steps("multiturn_workload")[:steps]:
        records = list(trace.workload(step))
        groups = sorted({r.prompt_group_id for r in records})
        stride = max(1, len(groups) // groups_per_step)
        keep = set(groups[::stride][:groups_per_step])
        chosen = [r for r in records if r.prompt_group_id in keep]
        _write(target / step_file("multiturn_workload", step), [r.to_dict() for r in chosen])
        written += len(chosen)
    for kind, read in (("packed_lengths", trace.packed_lengths), ("reward_timings", trace.reward_timings)):
        for step in trace.steps(kind)[:2]:  # type: ignore[arg-type]
            chosen_rows = [r.to_dict() for _, r in zip(range(rows), read(step), strict=False)]
            _write(target / step_file(kind, step), chosen_rows)
            written += len(chosen_rows)
    # The task-distribution parameters (170 kB of fits) are not sampled: read the published file.
    return written


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
