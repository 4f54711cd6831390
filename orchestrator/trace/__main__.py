"""``python -m orchestrator.trace <command>``:

* ``summarize <dir> [-o out]`` — the characterisation report (text and PNG plots) of a
  PolyTrace directory: a published trace or a run directory;
* ``sample <src> <dst>`` — cut a small sample out of a trace directory;
* ``generate --task math|tool_calling --steps N --batch B --seed S -o DIR`` — a synthetic
  multi-turn workload sampled from PolyTrace's published task distributions;
* ``export <dir> -o OUT`` — a plain copy of a run's (compressed, rolled) PolyTrace records in
  the published layout, ``<kind>_step_N.jsonl``;
* ``timeline <run_dir> [--steps A:B] [-o FILE]`` — the run's Perfetto timeline built from its
  spans, all of it or a window of steps (default ``<run_dir>/timeline-A_B.json``).

The replay engine's fit, once ``fit`` here, is ``python -m orchestrator.replay fit``: replay
reads traces, and this package imports nothing of replay (ARCHITECTURE.md's layers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"]:
        print("error: the replay engine's fit is `python -m orchestrator.replay fit` "
              f"{' '.join(argv[1:])}".rstrip(), file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m orchestrator.trace")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="characterise a trace or run directory (text + PNG)")
    s.add_argument("dir", type=Path)
    s.add_argument("-o", "--output", type=Path, default=None,
                   help="where the PNG plots go (default: <dir>/summary, or ./trace_summary "
                        "when <dir> is read-only)")
    s.add_argument("--no-plots", action="store_true")
    m = sub.add_parser("sample", help="cut a small sample out of a trace directory")
    m.add_argument("source", type=Path)
    m.add_argument("target", type=Path)
    m.add_argument("--groups", type=int, default=8)
    g = sub.add_parser("generate", help="a workload sampled from the published task distributions")
    g.add_argument("--task", required=True, choices=["math", "tool_calling"])
    g.add_argument("--steps", type=int, required=True)
    g.add_argument("--batch", type=int, required=True, help="trajectories per step")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-o", "--output", type=Path, required=True)
    g.add_argument("--max-response-tokens", type=int, default=16384)
    g.add_argument("--group-size", type=int, default=8, help="samples per prompt group")
    g.add_argument("--math-model", choices=["joint", "marginal"], default="joint",
                   help="math lengths: the published Gaussian mixture or the log-normal marginals")
    g.add_argument("--parameters", type=Path, default=None,
                   help="task_distribution_parameters.json (default: the shipped parameters)")
    e = sub.add_parser("export", help="a plain copy of a run's trace files, published layout")
    e.add_argument("dir", type=Path)
    e.add_argument("-o", "--output", type=Path, required=True)
    t = sub.add_parser("timeline", help="a run's Perfetto timeline (timeline.json) from its spans")
    t.add_argument("dir", type=Path)
    t.add_argument("--steps", default=None,
                   help="a window of train steps, A:B as a Python slice (--steps=-50: the "
                        "last 50); default: the whole run")
    t.add_argument("-o", "--output", type=Path, default=None,
                   help="default: <run_dir>/timeline.json (whole run) or timeline-A_B.json")
    args = parser.parse_args(argv)

    try:
        if args.command == "summarize":
            from orchestrator.trace.summarize import summarize

            summarize(args.dir, args.output, plots=not args.no_plots)
        elif args.command == "generate":
            from orchestrator.trace.generate import generate_workload

            out = generate_workload(args.task, args.steps, args.batch, args.seed, args.output,
                                    args.max_response_tokens, args.group_size, args.math_model,
                                    args.parameters)
            print(f"wrote {args.steps} steps of {args.batch} {args.task} trajectories to {out}")
        elif args.command == "export":
            from orchestrator.trace.writer import export_plain

            n = export_plain(args.dir, args.output)
            print(f"wrote {n} files to {args.output}")
        elif args.command == "timeline":
            timeline(args.dir, args.steps, args.output)
        else:
            from orchestrator.trace.sample import write_sample

            n = write_sample(args.source, args.target, groups_per_step=args.groups)
            print(f"wrote {n} records to {args.target}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def timeline(run_dir: Path, steps: str | None, output: Path | None) -> None:
    from orchestrator.trace.recorder import span_files, spans_path
    from orchestrator.trace.timeline import parse_steps, write_timeline

    spans = spans_path(run_dir)
    if not spans.exists() or not span_files(spans):
        raise FileNotFoundError(f"{run_dir} has no spans (spans/ or spans.jsonl): is it a run "
                                f"directory?")
    window = parse_steps(steps) if steps is not None else None
    name = "timeline.json" if steps is None else f"timeline-{steps.replace(':', '_')}.json"
    out = output or run_dir / name
    label = write_timeline(spans, out, process=run_dir.resolve().name, steps=window)
    print(f"wrote {out} ({label}); open it in https://ui.perfetto.dev (Open trace file) or "
          f"chrome://tracing")


if __name__ == "__main__":
    sys.exit(main())
