"""``python -m orchestrator.replay fit <dir> [--steps 0,1,2] [-o engine.json]``: fit the
replay engine's server model to the multi-turn workload steps of a PolyTrace directory and
save the :class:`~orchestrator.replay.fit.EngineFit` (``replay.engine=<file>`` uses it).
``python -m orchestrator.trace fit`` is an alias.
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
        raise argparse.ArgumentTypeError(
            f"steps must be comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.replay")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit the replay engine model to trace steps")
    f.add_argument("dir", type=Path)
    f.add_argument("--steps", type=_steps, default=None, help="e.g. 0,1,2 (default: all)")
    f.add_argument("--iterations", type=int, default=90)
    f.add_argument("--replicas", type=int, default=1,
                   help="play each trajectory this many times (to fit a sample of a step)")
    f.add_argument("-o", "--output", type=Path, default=Path("engine_fit.json"))
    args = parser.parse_args(argv)

    from orchestrator.replay.fit import fit_trace

    try:
        result = fit_trace(args.dir, args.steps, args.iterations, args.replicas)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(json.dumps(result.server.to_dict()))
    print(f"fitted steps {list(result.steps)} of {args.dir} (loss {result.loss:.4f}) "
          f"-> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
