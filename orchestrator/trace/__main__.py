"""``python -m orchestrator.trace <command>``:

* ``summarize <dir> [-o out]`` — the characterisation report (text and PNG plots) of a
  PolyTrace directory: a published trace or a run directory;
* ``sample <src> <dst>`` — cut a small sample out of a trace directory;
* ``generate --task math|tool_calling --steps N --batch B --seed S -o DIR`` — a synthetic
  multi-turn workload sampled from PolyTrace's published task distributions.

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
        else:
            from orchestrator.trace.sample import write_sample

            n = write_sample(args.source, args.target, groups_per_step=args.groups)
            print(f"wrote {n} records to {args.target}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
