"""Fidelity of the calibrated replay: fit the engine model on some trace steps, replay a step it
was not fitted on through the real pipeline, and compare with what was recorded.

Fit: :func:`orchestrator.replay.fit.fit` on ``--fit`` steps (closed-loop replays of the
standalone server model). Evaluation: the ``--eval`` step replayed by
:func:`orchestrator.replay.replay` — the run loop training uses, with the real
:class:`~orchestrator.pipeline.pipeline.Pipeline` at ``k = 0`` and the replay engine, environment,
trainer cost model and recorder, in virtual time — and three figures against the recorded
step:

* rollout makespan: the longest trajectory's end-to-end time (target: within 5%);
* median per-trajectory end-to-end time (target: within 10%);
* KS statistic between replayed and recorded per-turn engine latencies (target: <= 0.10).

End to end is generation plus tool time per trajectory, as in the trace (all of a step's
trajectories start together at 0). With the shipped sample (64 trajectories a step), every
trajectory is played ``--replicas`` times (default: enough to rebuild a 2,048-trajectory
step's load) and compared with the recorded sample: a smoke check, since a replicated 3%
sample is not the step's load (its long tail is replicated with it); the targets are for the
published steps. ``--smoke`` (the tests'): each trajectory played once and a fit of
``SMOKE_ITERATIONS`` Nelder-Mead iterations (seconds; its figures say nothing). The last line
is ``accuracy=<1 - |makespan relative error|>`` (PolyTrace reports 94.7% for its suite).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from bench.cli import add_smoke, headline
from orchestrator.config.schema import ReplayConfig
from orchestrator.replay import (
    EngineFit,
    fit_trace,
    plans_from_records,
    replay,
    resample_groups,
    run_virtual,
)
from orchestrator.replay.fit import episodes_from, ks_statistic, replay_fidelity
from orchestrator.trace.reader import SHIPPED_SAMPLE, TraceDir

FULL_STEP = 2048
SMOKE_ITERATIONS = 5


def steps_arg(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Replay fidelity on a held-out trace step.")
    parser.add_argument("--trace", type=Path, default=SHIPPED_SAMPLE,
                        help="a PolyTrace directory (default: the shipped search_r1 sample)")
    parser.add_argument("--fit", type=steps_arg, default=[0, 1, 2])
    parser.add_argument("--eval", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=None,
                        help="plays of each trajectory (default: up to a 2,048-trajectory step; "
                             "--smoke: 1)")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"Nelder-Mead iterations (default 90; --smoke {SMOKE_ITERATIONS})")
    add_smoke(parser)
    args = parser.parse_args(argv)
    iterations = args.iterations or (SMOKE_ITERATIONS if args.smoke else 90)
    if args.eval in args.fit:
        parser.error(f"--eval {args.eval} is among the --fit steps: evaluate on a held-out step")

    trace = TraceDir.open(args.trace)
    records = list(trace.workload(args.eval))
    replicas = args.replicas or (1 if args.smoke else max(1, FULL_STEP // len(records)))
    started = time.perf_counter()
    fit: EngineFit = fit_trace(args.trace, args.fit, iterations, replicas)
    fit_seconds = time.perf_counter() - started
    p = fit.server
    print(f"trace={trace.path} fit={args.fit} eval={args.eval} trajectories={len(records)} "
          f"replicas={replicas} iterations={iterations} fit_s={fit_seconds:.1f}")
    print(f"engine: step={p.step_base * 1e3:.2f} ms + {p.step_per_seq * 1e3:.3f} ms/seq + "
          f"{p.step_per_1k_tokens * 1e3:.3f} ms/1k tokens; prefill {p.prefill_per_1k * 1e3:.1f} "
          f"ms/1k tokens; max_running={p.max_running}")

    standalone = replay_fidelity(p, episodes_from(records), replicas)

    plans = plans_from_records(records)
    groups = len({pl.group for pl in plans}) * replicas
    plans = resample_groups(plans, groups)
    started = time.perf_counter()
    result = run_virtual(replay, plans, fit, ReplayConfig(groups_per_step=None, num_steps=1))
    replay_seconds = time.perf_counter() - started
    episodes = [e for r in result.reports for g in r.timings for e in g.episodes]
    e2e = [e.finished_at - e.started_at for e in episodes]
    latencies = [turn.latency for e in episodes for turn in e.turns]
    observed_e2e = [r.end_to_end_s for r in records]
    observed_lat = [t.engine_latency_s for r in records for t in r.turns]
    makespan_error = max(e2e) / max(observed_e2e) - 1.0
    median_error = statistics.median(e2e) / statistics.median(observed_e2e) - 1.0
    ks = ks_statistic(latencies, observed_lat)

    print(f"standalone model: makespan_err={standalone.makespan_error:+.2%} "
          f"median_e2e_err={standalone.median_e2e_error:+.2%} ks={standalone.latency_ks:.3f}")
    print(f"pipeline replay ({len(episodes)} trajectories, {replay_seconds:.1f} s real, "
          f"{result.wall:.0f} s virtual incl. train step):")
    rows = [
        ("rollout makespan s", max(observed_e2e), max(e2e), makespan_error, 0.05),
        ("median e2e s", statistics.median(observed_e2e), statistics.median(e2e), median_error, 0.10),
    ]
    print(f"  {'metric':<20} {'trace':>9} {'replay':>9} {'error':>8} {'target':>7}")
    for name, obs, sim, err, target in rows:
        ok = "ok" if abs(err) <= target else "MISS"
        print(f"  {name:<20} {obs:>9.1f} {sim:>9.1f} {err:>+8.2%} {target:>6.0%} {ok}")
    print(f"  {'turn latency KS':<20} {'':>9} {'':>9} {ks:>8.3f} {0.10:>7.2f} "
          f"{'ok' if ks <= 0.10 else 'MISS'}")
    if replicas > 1:
        print(f"note: a sample of {len(records)} trajectories played {replicas} times is not the "
              f"step it was cut from (its tail is replicated too); the targets are for full steps: "
              f"--trace ../shared/polytrace/search_r1")
    headline("accuracy", 1.0 - abs(makespan_error), 4)


if __name__ == "__main__":
    main()
