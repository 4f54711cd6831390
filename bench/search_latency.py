"""Fidelity of the search latency model against a PolyTrace trace.

For each mode (empirical, parametric) it draws one latency and status per recorded tool
call, with the recorded ``query_count``, and compares with the record: the two-sample KS
statistic of latencies, p50/p90/p99 relative errors, and failure rates (``unknown``,
``api_error``). Targets: KS <= 0.05, percentiles within 10%, rates within 1 point.
Last line: ``ks=<the larger of the two modes' KS>``.
"""

from __future__ import annotations

import argparse
import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.cli import add_smoke, headline, refuse
from orchestrator.trace.reader import SHIPPED_SAMPLE
from sandboxes.search.latency import TraceFaultModel, fit, read_tool_calls

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "polytrace" / "search_r1"


def ks_statistic(a: list[float], b: list[float]) -> float:
    a, b = sorted(a), sorted(b)
    gap = 0.0
    for x in a + b:
        fa = bisect.bisect_right(a, x) / len(a)
        fb = bisect.bisect_right(b, x) / len(b)
        gap = max(gap, abs(fa - fb))
    return gap


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.search_latency")
    parser.add_argument("--trace", type=Path, default=None,
                        help=f"a PolyTrace directory (default: {DEFAULT_TRACE}; --smoke: the "
                             "shipped sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--refit", action="store_true",
                        help="fit from --trace instead of using the shipped fit")
    add_smoke(parser)
    args = parser.parse_args(argv)
    trace = args.trace or (SHIPPED_SAMPLE if args.smoke else DEFAULT_TRACE)
    try:
        records = read_tool_calls(trace)
    except FileNotFoundError as e:
        refuse("search_latency", f"{e} (--trace names another; --smoke reads the shipped sample)")
    recorded = [r.latency_s for r in records]
    fitted = fit(records) if args.refit else None
    print(f"trace={trace} tool_calls={len(records)} fit={'refit' if args.refit else 'shipped'}")
    print(f"{'mode':<11} {'ks':>6} {'p50_err':>8} {'p90_err':>8} {'p99_err':>8} "
          f"{'unknown':>8} {'api_err':>8}")
    rec_q = np.quantile(recorded, [0.5, 0.9, 0.99])
    rates = {s: sum(r.status == s for r in records) / len(records) for s in ("unknown", "api_error")}
    print(f"{'recorded':<11} {'':>6} {rec_q[0]:>8.3f} {rec_q[1]:>8.3f} {rec_q[2]:>8.3f} "
          f"{rates['unknown']:>8.4f} {rates['api_error']:>8.4f}")
    worst = 0.0
    for mode in ("empirical", "parametric"):
        model = TraceFaultModel(mode, fitted, seed=args.seed)
        draws = [model.sample(r.query_count) for r in records]
        latencies = [d[0] for d in draws]
        ks = ks_statistic(recorded, latencies)
        q = np.quantile(latencies, [0.5, 0.9, 0.99])
        err = np.abs(q - rec_q) / rec_q
        sim = {s: sum(d[1] == s for d in draws) / len(draws) for s in rates}
        print(f"{mode:<11} {ks:>6.4f} {err[0]:>8.3f} {err[1]:>8.3f} {err[2]:>8.3f} "
              f"{sim['unknown']:>8.4f} {sim['api_error']:>8.4f}")
        worst = max(worst, ks)
    headline("ks", worst, 4)


if __name__ == "__main__":
    main()
