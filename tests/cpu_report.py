"""What a test run cost, by test file: ``POLYRL_TEST_CPU=<folder> bash scripts/test.sh``, then
``python tests/cpu_report.py <folder> [count]`` (the costliest files first; tests/conftest.py
writes the figures). CPU is this process's and the subprocesses' it waited for: a Ray
cluster's actors are not counted, so a Ray test's wall time is the better guide there."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: str, count: int = 30) -> None:
    rows = [row for path in sorted(Path(folder).glob("*.json")) for row in json.loads(path.read_text())]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rows:
        f = files[row["test"].split("::")[0]]
        f[0] += row["wall_s"]
        f[1] += row["cpu_s"] + row["subprocess_cpu_s"]
        f[2] += row["subprocess_cpu_s"]
        f[3] += 1
    print(f"{len(rows)} tests: {sum(f[0] for f in files.values()):.0f} s of wall time, "
          f"{sum(f[1] for f in files.values()):.0f} CPU-s counted")
    print(f"{'CPU-s':>7} {'of it in subprocesses':>22} {'wall s':>7} {'tests':>6}  file")
    for name, (wall, cpu, sub, n) in sorted(files.items(), key=lambda kv: -kv[1][1])[:count]:
        print(f"{cpu:7.0f} {sub:22.0f} {wall:7.0f} {int(n):6d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
