"""``env=dataset`` at scale, and its reward off the critical path.

1. **Start-up and memory** (``startup``): Parquet files of 1,000,000 and of 1,000 rows (plain
   schema: ``question`` / ``answer``, two-digit sums, written by pyarrow into ``--out``), each
   trained for one step by ``python -m orchestrator experiment=smoke env=dataset`` (no warm
   start, no evaluation) in a subprocess: its wall time from start to exit and its peak
   resident memory (the run's own ``ru_maxrss``, which it writes into ``summary.json`` as
   ``peak_rss_mb``). The first read of a Parquet or JSONL file
   converts it into an Arrow file in ``datasets``' cache; that conversion is timed apart (a run of its
   own before the timed one), since it happens once per file. Figures: seconds to the end of
   the step for each size, and the 1M run's extra resident memory over the 1k run's
   (target <= 200 MB).
2. **Reward off the critical path** (``reward``): the same short run (``experiment=smoke`` on
   the 1,000-row file, shaped like a real step: 64-token replies, 64 samples a step, 8 rollout
   workers, ``--steps`` steps) with ``env.reward=exact`` (scored in the run's own process),
   ``env.reward=math`` (math-verify in worker processes, where a parse is needed),
   ``math`` plus a user's function that returns at once (``bench.dataset_rewards:zero``:
   what isolating a function costs) and ``math`` plus one that never returns for one call in
   50 (``bench.dataset_rewards:hang_one_in_50``, ``env.reward_timeout_s=1``): samples/s from
   each run's ``summary.json``, as ratios to ``exact`` (targets: math >= 0.95, with hangs
   >= 0.9), and the hung run's ``reward/timeouts`` and samples dropped as stale. A hang costs
   its group when the limit is longer than the staleness window (``k + 1`` steps): with the
   smoke run's own 50 ms steps a 1 s limit is 20 steps, so every hung group is dropped and the
   ratio is bounded by the share of groups with a hang (1 - 0.98^4, 8%) and the isolation's
   cost; these 0.8 s steps are nearer a real run's.

3. **Reading a large file** (``load``): a JSON Lines file of ``--load-mb`` MB (1,024: 1 GB) in
   verl's schema (``data_source``, ``prompt`` as messages, ``ability``,
   ``reward_model.ground_truth``, ``extra_info``; prompts of a few hundred characters, as in
   math sets), generated into a temporary folder and deleted after, read by ``env=dataset``'s
   own reader (a ``DatasetSpec`` over it) in a child process that sets glibc's malloc as a
   run does: its peak resident memory (``VmHWM``; a forked child's ``ru_maxrss`` keeps its
   parent's) and what it holds after loading above its own baseline (the interpreter after
   reading a one-row file: ``envs.dataset``, ``datasets``, ``pyarrow`` and the reward
   imported), on the first read (converted into Arrow, checked) and the next (the converted
   file mapped again and checked). Targets for 1 GB: peak <= 1,024 MB, held <= 200 MB. Then a
   thousand rows spread over the file are built as tasks: the mapped file's pages they bring
   in (the kernel maps a page's neighbours with it) are counted apart, file-backed memory the
   kernel takes back when it needs it.

On the tiny model the replies are short strings of characters, so verification costs what it
costs on a parse of such text; the point is that the run does not wait on it.

``--quick``: 4 steps a reward run (default 15). ``--rows N``: the large file's rows (default
1,000,000). ``--parts``: which of ``load,reward,startup`` (default all three, in that order).
``--smoke`` (the tests', about half a minute: four runs of a few seconds each, and an 8 MB
file's first read) is the load and start-up parts with a 10,000-row file against the 1,000-row one, in a
temporary folder (``--parts load,reward,startup`` adds the reward runs, 2 steps each); it
checks the bench runs end to end, its figures say nothing. Last line:
``dataset_extra_rss_mb_1m=<value>`` (named after the large file's size:
``dataset_extra_rss_mb_10k`` at ``--smoke``); with ``--parts load``,
``dataset_peak_rss_mb_1gb=<value>`` (the first read's peak; ``_8mb`` at ``--smoke``), after
``dataset_held_rss_mb_1gb=``. Needs the
data extra (``pip install -e '.[data]'``); without it the bench says so in one line and exits
with status 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.cli import add_smoke, headline, refuse
from bench.machine import machine

REPO = Path(__file__).resolve().parent.parent
SMALL, LARGE = 1_000, 1_000_000  # the two files' rows (--rows: the large one's)
SMOKE_ROWS, SMOKE_STEPS = 10_000, 2


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` two-digit sums as a Parquet file (plain schema), written in chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists():
        return path
    rng = random.Random(seed)
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, 100_000):
            a = [rng.randrange(10, 100) for _ in range(min(100_000, rows - start))]
            b = [rng.randrange(10, 100) for _ in a]
            writer.write_table(pa.table({
                "question": [f"{x}+{y}=" for x, y in zip(a, b, strict=True)],
                "answer": [str(x + y) for x, y in zip(a, b, strict=True)]}, schema=schema))
    tmp.rename(path)
    return path


def run(out: Path, name: str, *overrides: str) -> tuple[float, float, dict[str, float]]:
    """One ``python -m orchestrator`` run (a subprocess, its output in ``<name>.log``): (wall
    seconds, its peak RSS in MB, its summary.json). The peak is the run's own
    (``summary.json``'s ``peak_rss_mb``, its ``ru_maxrss``)."""
    run_dir = out / name
    command = [sys.executable, "-m", "orchestrator", "experiment=smoke", "env=dataset",
               "logger=none", "progress=false", "warmstart.steps=0", "eval.num_tasks=0",
               f"hydra.run.dir={run_dir}", *overrides]
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              check=False).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{name} failed; see {out / f'{name}.log'}:\n"
                         f"{(out / f'{name}.log').read_text()[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return wall, summary["peak_rss_mb"], summary


def size_name(rows: int) -> str:
    """``1m``, ``10k``, ``1500``: a file's rows as the headline names them."""
    for unit, suffix in ((1_000_000, "m"), (1_000, "k")):
        if rows >= unit and rows % unit == 0:
            return f"{rows // unit}{suffix}"
    return str(rows)


def startup(out: Path, large: int = LARGE) -> float:
    """The large file's one-step run's extra peak RSS (MB) over the small file's."""
    print(f"{'rows':>10} {'convert s':>10} {'1 step s':>9} {'peak RSS MB':>12}", flush=True)
    sizes = (SMALL, large)
    rss = {}
    for rows in sizes:
        path = write_rows(out / f"sums_{rows}.parquet", rows)
        train = f"env.train={path}"
        convert, _, _ = run(out, f"convert_{rows}", train, "pipeline.num_steps=1")
        wall, peak, _ = run(out, f"startup_{rows}", train, "pipeline.num_steps=1")
        rss[rows] = peak
        print(f"{rows:>10,} {convert:>10.1f} {wall:>9.1f} {peak:>12.0f}", flush=True)
    return rss[large] - rss[SMALL]


def rewards(out: Path, steps: int) -> None:
    train = f"env.train={write_rows(out / f'sums_{SMALL}.parquet', SMALL)}"
    shape = [f"pipeline.num_steps={steps}", "rollout.max_tokens=64", "pipeline.batch_size=64",
             "pipeline.num_workers=8"]
    variants = {
        "exact": ["env.reward=exact"],
        "math": ["env.reward=math"],
        "math+fn": ["env.reward=[math,'bench.dataset_rewards:zero']"],
        "math+hang": ["env.reward=[math,'bench.dataset_rewards:hang_one_in_50']",
                      "env.reward_timeout_s=1"],
    }
    rates = {}
    print(f"{'reward':<10} {'samples/s':>9} {'ratio':>6} {'timeouts':>9} {'stale':>6}", flush=True)
    for name, overrides in variants.items():
        _, _, summary = run(out, f"reward_{name}", train, *shape, *overrides)
        rates[name] = summary["samples_per_s"]
        metrics = [json.loads(line) for line in
                   (out / f"reward_{name}" / "metrics.jsonl").read_text().splitlines()]
        timeouts = max((m.get("reward/timeouts", 0.0) for m in metrics), default=0.0)
        print(f"{name:<10} {rates[name]:>9.1f} {rates[name] / rates['exact']:>6.2f} "
              f"{timeouts:>9.0f} {summary['dropped_stale']:>6}", flush=True)
    print(f"math_vs_exact={rates['math'] / rates['exact']:.3f}")
    print(f"math_with_hangs_vs_exact={rates['math+hang'] / rates['exact']:.3f}")


LOAD_MB, SMOKE_LOAD_MB = 1024, 8
MEASURE = """
import gc, json, os, sys
from orchestrator.allocator import keep_freed_memory
keep_freed_memory()  # as python -m orchestrator does, first thing
import datasets, pyarrow
from envs.dataset import DatasetSpec
def rss():
    # resident MB: anonymous (the process's own) and file-backed (mapped file pages)
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}
def peak():
    # this process's high-water mark (VmHWM: ru_maxrss would keep the forking parent's)
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) / 1024
tiny = os.path.join(os.environ["HF_DATASETS_CACHE"], "one.jsonl")
os.makedirs(os.path.dirname(tiny), exist_ok=True)
with open(tiny, "w") as f:
    f.write(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                        "reward_model": {"ground_truth": "2"}}) + "\\n")
DatasetSpec(train=tiny)  # what reading any file imports and builds: the baseline's
gc.collect()
baseline = rss()
spec = DatasetSpec(train=sys.argv[1])
gc.collect()
loaded = rss()
loaded_peak = peak()
tasks = spec.tasks("train")
step = max(1, len(tasks) // 1000)
answers = sum(len(tasks[i].answer) for i in range(0, len(tasks), step))
gc.collect()
used = rss()
print(json.dumps({"rows": len(tasks), "baseline": sum(baseline.values()),
                  "held": sum(loaded.values()) - sum(baseline.values()),
                  "held_anon": loaded["RssAnon"] - baseline["RssAnon"],
                  "tasks_file": used["RssFile"] - loaded["RssFile"],
                  "peak": loaded_peak, "peak_rows": peak()}))
"""


def write_verl(path: Path, megabytes: int, seed: int = 0) -> int:
    """A verl-schema JSON Lines file of about ``megabytes`` MB; its rows."""
    rng = random.Random(seed)
    words = ["integer", "triangle", "probability", "sum", "digits", "prime", "circle", "area",
             "positive", "remainder", "sequence", "function", "real", "number", "find"]
    rows, size, limit = 0, 0, megabytes * 2**20
    with open(path, "w") as file:
        while size < limit:
            a, b = rng.randrange(1, 10**6), rng.randrange(1, 10**6)
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(40, 120)))
            line = json.dumps({
                "data_source": rng.choice(["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"]),
                "prompt": [{"role": "user", "content": f"{text}: what is {a} + {b}? Let's think "
                            "step by step and output the final answer after \"####\"."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": rows, "question": f"{a} + {b}"},
            }) + "\n"
            file.write(line)
            size += len(line)
            rows += 1
    return rows


def measure_load(path: Path, cache: Path) -> dict[str, float]:
    """One child process reading ``path`` as a run does (its datasets cache ``cache``)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path)], cwd=REPO, check=False,
                          capture_output=True, text=True,
                          env={**os.environ, "HF_DATASETS_CACHE": str(cache),
                               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
                                   "PYTHONPATH", "")])})
    if done.returncode != 0:
        raise SystemExit(f"reading {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mb_name(megabytes: int) -> str:
    return f"{megabytes // 1024}gb" if megabytes % 1024 == 0 else f"{megabytes}mb"


def load(megabytes: int, reads: Sequence[str] = ("first", "cached")) -> float:
    """The first read's peak RSS (MB) of a verl-schema file of ``megabytes`` MB (``reads``:
    the first, then the cached one)."""
    with tempfile.TemporaryDirectory(prefix="bench-dataset-load-") as folder:
        path = Path(folder) / "verl.jsonl"
        started = time.perf_counter()
        rows = write_verl(path, megabytes)
        print(f"load: {path.stat().st_size / 2**20:,.0f} MB, {rows:,} rows (verl schema), "
              f"written in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"{'read':<8} {'s':>6} {'baseline MB':>12} {'peak MB':>8} {'held MB':>8} "
              f"{'of it anon':>10} {'1000 rows: mapped MB':>21} {'peak MB':>8}", flush=True)
        figures = {}
        for read in reads:
            started = time.perf_counter()
            figures[read] = measure_load(path, Path(folder) / "cache")
            f = figures[read]
            assert f["rows"] == rows, (f, rows)
            print(f"{read:<8} {time.perf_counter() - started:>6.1f} {f['baseline']:>12.0f} "
                  f"{f['peak']:>8.0f} {f['held']:>8.0f} {f['held_anon']:>10.0f} "
                  f"{f['tasks_file']:>21.0f} {f['peak_rows']:>8.0f}", flush=True)
    name = mb_name(megabytes)
    if "cached" in figures:
        print(f"dataset_peak_rss_mb_{name}_cached={figures['cached']['peak']:.0f}")
    print(f"dataset_held_rss_mb_{name}={max(f['held'] for f in figures.values()):.0f}",
          flush=True)
    return figures["first"]["peak"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the files and runs go (default: runs/bench_dataset, kept "
                             "for the next time; --smoke: a temporary folder)")
    parser.add_argument("--steps", type=int, default=None, help="steps a reward run (15)")
    parser.add_argument("--quick", action="store_true", help="4 steps a reward run")
    parser.add_argument("--rows", type=int, default=None,
                        help=f"the large file's rows ({LARGE:,}; --smoke {SMOKE_ROWS:,})")
    parser.add_argument("--parts", default=None,
                        help="load,reward,startup (--smoke: load,startup)")
    parser.add_argument("--load-mb", type=int, default=None,
                        help=f"the load part's file, MB ({LOAD_MB:,}; --smoke {SMOKE_LOAD_MB})")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if missing := [m for m in ("pyarrow", "datasets") if importlib.util.find_spec(m) is None]:
        refuse("dataset", f"{' and '.join(missing)} missing: pip install -e '.[data]'")
    parts = (args.parts or ("load,startup" if args.smoke else "load,reward,startup")).split(",")
    load_mb = args.load_mb or (SMOKE_LOAD_MB if args.smoke else LOAD_MB)
    steps = args.steps or (SMOKE_STEPS if args.smoke else 4 if args.quick else 15)
    rows = args.rows or (SMOKE_ROWS if args.smoke else LARGE)
    if rows <= SMALL:
        parser.error(f"--rows {rows}: the large file must have more than {SMALL:,} rows")
    with ExitStack() as stack:
        out = args.out or (Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="bench-dataset-"))) if args.smoke else REPO / "runs" / "bench_dataset")
        out.mkdir(parents=True, exist_ok=True)
        print(machine(), flush=True)
        if "load" in parts:
            peak = load(load_mb, ("first",) if args.smoke else ("first", "cached"))
            if parts == ["load"]:
                headline(f"dataset_peak_rss_mb_{mb_name(load_mb)}", peak, 0)
            else:
                print(f"dataset_peak_rss_mb_{mb_name(load_mb)}={peak:.0f}", flush=True)
        if "reward" in parts:
            rewards(out, steps)
        if "startup" in parts:
            extra = startup(out, rows)
            headline(f"dataset_extra_rss_mb_{size_name(rows)}", extra, 1)


if __name__ == "__main__":
    main()
