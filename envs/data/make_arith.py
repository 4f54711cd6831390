"""The small dataset file that ``experiment=dataset_smol`` learns from, written in code.

    python -m envs.data.make_arith [--out envs/data] [--train 224] [--eval 100] [--seed 0]

One-digit arithmetic in verl's Parquet schema: ``data_source``, ``prompt`` as a list of
``{role, content}`` messages, ``ability``, ``reward_model: {style: rule, ground_truth}`` and
``extra_info: {split, index, kind, question}``, with the ground truth written in LaTeX where
that is natural: a difference may be negative (``-4``) and a quotient is a fraction in lowest
terms (``\\frac{7}{2}``; ``3`` when it divides). Plain Python from one seed (``random.Random``,
stable across Python versions), nothing downloaded; a question is in at most one split.
Writes ``arith_train.parquet`` and ``arith_eval.parquet``; ``--kinds`` and ``--phrasing`` are
the knobs the base rates were measured over (``python -m bench.dataset_base_rates``).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ("add", "sub", "mul", "div")
SYMBOL = {"add": "+", "sub": "-", "mul": "\\times", "div": "\\div"}
WORD = {"add": "plus", "sub": "minus", "mul": "times", "div": "divided by"}
ASCII = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def latex(value: Fraction) -> str:
    """``-4``, ``\\frac{7}{2}``, ``-\\frac{1}{3}``: a value as a LaTeX ground truth."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def value(kind: str, a: int, b: int) -> Fraction:
    return {"add": lambda: Fraction(a + b), "sub": lambda: Fraction(a - b),
            "mul": lambda: Fraction(a * b), "div": lambda: Fraction(a, b)}[kind]()


def question(kind: str, a: int, b: int, phrasing: str) -> str:
    if phrasing == "latex":
        return f"What is ${a} {SYMBOL[kind]} {b}$?"
    if phrasing == "words":
        return f"What is {a} {WORD[kind]} {b}?"
    return f"What is {a} {ASCII[kind]} {b}?"


def pairs(kind: str) -> list[tuple[int, int]]:
    """Every one-digit question of a kind: 0-9 with 0-9, a divisor 1-9 and a dividend 1-9."""
    low = 1 if kind == "div" else 0
    return [(a, b) for a in range(low, 10) for b in range(low, 10)]


def rows(kinds: Sequence[str], phrasing: str, train: int, eval: int, seed: int,
         source: Callable[[str], str] = lambda kind: f"arith_{kind}") -> dict[str, list[dict[str, Any]]]:
    """Train and eval rows, each kind an equal share of both splits, no question in both."""
    rng = random.Random(seed)
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for n, kind in enumerate(kinds):
        questions = pairs(kind)
        rng.shuffle(questions)
        want = {split: size // len(kinds) + (n < size % len(kinds))
                for split, size in (("eval", eval), ("train", train))}
        if want["eval"] + want["train"] > len(questions):
            raise SystemExit(f"{kind}: {len(questions)} distinct questions, asked for "
                             f"{want['eval']} eval + {want['train']} train")
        chosen = {"eval": questions[:want["eval"]],
                  "train": questions[want["eval"]:want["eval"] + want["train"]]}
        for split, picked in chosen.items():
            for a, b in picked:
                text = question(kind, a, b, phrasing)
                out[split].append({
                    "data_source": source(kind),
                    "prompt": [{"role": "user", "content": text}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": latex(value(kind, a, b))},
                    "extra_info": {"split": split, "index": 0, "kind": kind, "question": text},
                })
    for split, listed in out.items():
        rng.shuffle(listed)
        for i, row in enumerate(listed):
            row["extra_info"]["index"] = i
    return out


def write(out_dir: Path, kinds: Sequence[str] = KINDS, phrasing: str = "latex", train: int = 224,
          eval: int = 100, seed: int = 0, prefix: str = "arith") -> dict[str, Path]:
    """Write ``<prefix>_train.parquet`` and ``<prefix>_eval.parquet``; their paths by split."""
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, listed in rows(kinds, phrasing, train, eval, seed).items():
        paths[split] = out_dir / f"{prefix}_{split}.parquet"
        pd.DataFrame(listed).to_parquet(paths[split], index=False)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--phrasing", choices=("ascii", "words", "latex"), default="latex")
    parser.add_argument("--train", type=int, default=224)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kind {unknown[0]!r}; kinds: {', '.join(KINDS)}")
    for split, path in write(args.out, kinds, args.phrasing, args.train, args.eval,
                             args.seed).items():
        print(f"{split}: {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
