"""``python -m orchestrator.trace <command>``:

* ``summarize <dir> [-o out]`` — the characterisation report (text and PNG plots) of a
  PolyTrace directory: a published trace or a run directory;
* ``fit <dir> [--steps 0,1,2] [-o engine.json]`` — fit the replay engine model;
* ``sample <src> <dst>`` — cut a small sample out of a trace directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps must be comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.trace")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="characterise a trace or run directory (text + PNG)")
    s.add_argument("dir", type=Path)
    s.add_argument("-o", "--output", type=Path, default=None,
                   help="where the PNG plots go (default: <dir>/summary, or ./trace_summary "
                        "when <dir> is read-only)")
    s.add_argument("--no-plots", action="store_true")
    f = sub.add_parser("fit", help="fit the replay engine model to trace steps")
    f.add_argument("dir", type=Path)
    f.add_argument("--steps", type=_steps, default=None, help="e.g. 0,1,2 (default: all)")
    f.add_argument("--iterations", type=int, default=90)
    f.add_argument("--replicas", type=int, default=1,
                   help="play each trajectory this many times (to fit a sample of a step)")
    f.add_argument("-o", "--output", type=Path, default=Path("engine_fit.json"))
    m = sub.add_parser("sample", help="cut a small sample out of a trace directory")
    m.add_argument("source", type=Path)
    m.add_argument("target", type=Path)
    m.add_argument("--groups", type=int, default=8)
    args = parser.parse_args(argv)

    try:
        if args.command == "summarize":
            from orchestrator.trace.summarize import summarize

            summarize(args.dir, args.output, plots=not args.no_plots)
        elif args.command == "fit":
            from orchestrator.trace.fitting import fit_trace

            result = fit_trace(args.dir, args.steps, args.iterations, args.replicas)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
            print(json.dumps(result.server.to_dict()))
            print(f"fitted steps {list(result.steps)} of {args.dir} (loss {result.loss:.4f}) "
                  f"-> {args.output}")
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
