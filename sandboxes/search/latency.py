"""Search latency and failures modelled from PolyTrace ``tool_calls`` records.

The model conditions on ``query_count`` (buckets ``0``, ``1``, ``2``, ``3+``): per bucket it
keeps the status frequencies (``success | unknown | api_error``) and, per status, the
latency distribution in one of two modes:

* ``empirical`` — replay: 201 quantiles of log-latency; a draw interpolates the inverse CDF
  at a uniform point, so samples follow the recorded distribution;
* ``parametric`` — a 3-component log-normal mixture fitted by EM (one component when a
  bucket has too few records).

``python -m sandboxes.search.latency fit <trace_dir> [-o file.json]`` fits both from any
directory of ``multiturn_workload_step_*.jsonl`` files; the package ships the fit of the
published search_r1 trace (``data/search_r1_latency.json``), so nothing reads a trace at
run time. Draws are seedable, and ``time_scale`` (on the server) shrinks them for tests.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sandboxes.search.server import FaultModel

SHIPPED = Path(__file__).parent / "data" / "search_r1_latency.json"
STATUSES = ("success", "unknown", "api_error")
FLOOR = 1e-5  # seconds: log-latency needs a positive value


@dataclass(frozen=True)
class CallRecord:
    query_count: int
    latency_s: float
    status: str


def bucket(query_count: int) -> str:
    return str(query_count) if query_count < 3 else "3+"


def read_tool_calls(trace_dir: Path) -> list[CallRecord]:
    files = sorted(Path(trace_dir).glob("multiturn_workload_step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{trace_dir} holds no multiturn_workload_step_*.jsonl files")
    records = []
    for path in files:
        with path.open() as f:
            for line_no, line in enumerate(f, 1):
                try:
                    for call in json.loads(line).get("tool_calls", []):
                        records.append(CallRecord(int(call["query_count"]), float(call["latency_s"]),
                                                  str(call["status"])))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{line_no}: not a multi-turn workload record ({e})") from e
    return records


def _mixture(logs: np.ndarray, k: int = 3, iterations: int = 300) -> dict[str, list[float]]:
    if len(logs) < 30 or float(logs.std()) < 1e-9:
        return {"weights": [1.0], "means": [float(logs.mean())], "sigmas": [max(float(logs.std()), 1e-3)]}
    means = np.quantile(logs, np.linspace(0.15, 0.85, k))
    sigmas = np.full(k, logs.std() / k)
    weights = np.full(k, 1.0 / k)
    for _ in range(iterations):
        dens = weights * np.exp(-0.5 * ((logs[:, None] - means) / sigmas) ** 2) / sigmas
        resp = dens / np.maximum(dens.sum(1, keepdims=True), 1e-300)
        nk = resp.sum(0) + 1e-12
        weights = nk / len(logs)
        means = (resp * logs[:, None]).sum(0) / nk
        sigmas = np.sqrt((resp * (logs[:, None] - means) ** 2).sum(0) / nk).clip(1e-3)
    return {"weights": weights.tolist(), "means": means.tolist(), "sigmas": sigmas.tolist()}


def fit(records: Iterable[CallRecord]) -> dict[str, Any]:
    grouped: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        grouped[bucket(r.query_count)][r.status].append(max(r.latency_s, FLOOR))
    buckets: dict[str, Any] = {}
    for name, by_status in sorted(grouped.items()):
        total = sum(len(v) for v in by_status.values())
        entry: dict[str, Any] = {"count": total, "status": {}, "empirical": {}, "parametric": {}}
        for status, values in sorted(by_status.items()):
            logs = np.log(np.asarray(values))
            entry["status"][status] = len(values) / total
            entry["empirical"][status] = np.quantile(logs, np.linspace(0, 1, 201)).tolist()
            entry["parametric"][status] = _mixture(logs)
        buckets[name] = entry
    return {"source": "PolyTrace tool_calls", "buckets": buckets}


class TraceFaultModel(FaultModel):
    """Latency and status per request, drawn from a fit (the shipped one by default)."""

    def __init__(self, mode: str = "empirical", fitted: dict[str, Any] | None = None,
                 seed: int | None = 0) -> None:
        if mode not in ("empirical", "parametric"):
            raise ValueError(f"latency mode {mode!r} must be 'empirical' or 'parametric'")
        self.mode = mode
        self.fitted = fitted if fitted is not None else json.loads(SHIPPED.read_text())
        self.rng = random.Random(seed)

    def _bucket(self, query_count: int) -> dict[str, Any]:
        buckets = self.fitted["buckets"]
        name = bucket(query_count)
        return buckets.get(name) or buckets.get("1") or next(iter(buckets.values()))

    def sample(self, query_count: int) -> tuple[float, str]:
        entry = self._bucket(query_count)
        statuses = list(entry["status"])
        status = self.rng.choices(statuses, weights=[entry["status"][s] for s in statuses])[0]
        if self.mode == "empirical":
            q = entry["empirical"][status]
            x = self.rng.random() * (len(q) - 1)
            i = min(int(x), len(q) - 2)
            log_latency = q[i] + (q[i + 1] - q[i]) * (x - i)
        else:
            p = entry["parametric"][status]
            j = self.rng.choices(range(len(p["weights"])), weights=p["weights"])[0]
            log_latency = self.rng.gauss(p["means"][j], p["sigmas"][j])
        return math.exp(log_latency), status


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.search.latency")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("fit", help="fit the latency model from a PolyTrace trace directory")
    cmd.add_argument("trace_dir", type=Path)
    cmd.add_argument("-o", "--output", type=Path, default=SHIPPED)
    args = parser.parse_args()
    records = read_tool_calls(args.trace_dir)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(fit(records)) + "\n")
    print(f"fitted {len(records)} tool calls from {args.trace_dir} -> {args.output}")


if __name__ == "__main__":
    main()
