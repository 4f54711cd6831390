"""What every benchmark shares on its command line: ``--smoke`` (the smallest size, run by the
tests), and the one-line refusal when the machine cannot give a figure.

A benchmark prints its headline figure as its last line, ``name=value``. When its run cannot
reach the measurement (a missing extra, no GPU, no Docker, a run too short to see the event it
waits for) it says so in one line and exits non-zero: :func:`refuse`. It never prints a figure
it did not measure.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

REFUSED = 3  # the exit status of a benchmark that could not measure (argparse uses 2)
# The toy model a smoke size runs (the tests' own: tests/helpers.py TINY_MODEL), as overrides
# of any experiment's model: the tiny Llama with the character tokenizer, built from config.
TOY_MODEL = ("model=tiny", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
             "model.intermediate_size=64")


def refuse(name: str, why: str) -> NoReturn:
    """Print ``bench.<name>: cannot measure: <why>`` to stderr and exit with :data:`REFUSED`."""
    print(f"bench.{name}: cannot measure: {why}", file=sys.stderr, flush=True)
    raise SystemExit(REFUSED)


def add_smoke(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the smallest size (a toy model, a few steps, seconds), what the tests run to
    check the benchmark still works end to end; its figures say nothing."""
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (seconds; what the tests run): checks the "
                             "benchmark works, its figures say nothing")


def headline(name: str, value: float, digits: int = 3, spec: str | None = None) -> None:
    """Print the headline as the last line (``spec``: a format of its own, ``.3g`` for a
    figure that spans magnitudes, instead of ``digits`` decimals); a value that is not finite
    is a refusal, never a figure."""
    if not math.isfinite(value):
        print(f"{name}: cannot measure: it came out {value}", file=sys.stderr, flush=True)
        raise SystemExit(REFUSED)
    print(f"{name}={value:{spec or f'.{digits}f'}}", flush=True)
