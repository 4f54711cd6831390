"""The characterisation report: ``python -m orchestrator.trace summarize <dir>``.

For every PolyTrace directory at or below ``<dir>`` (a task: ``search_r1``, ``rllm``, a run
directory, …) it prints and plots what the PolyTrace study characterises:

* input and output length distributions and their long tail (p50, p90, p99, max, max/p50),
  from multi-turn workloads (prompt and response tokens per trajectory) and packed lengths
  (per sample);
* turns and tool calls per trajectory;
* tool latency p50/p90/p99/max and failure rate (any status but ``success``);
* the per-stage time breakdown: engine and tool time from the workload records, reward time
  from reward timings, and — in a run directory, from its spans (``spans/``, or the earlier
  ``spans.jsonl``) — every stage the recorder timed (generate, tool_call, reward, train_step, weight_sync, waits);
* the engine idle fraction: the share of a step's span (a run's wall time) in which no
  generation request was in flight. For a published step every trajectory starts at 0 and
  its turns and tool calls follow each other, as recorded; for a run, the spans say.

Plots are PNG files (``lengths.png``, ``structure.png``, ``tool_latency.png``,
``stages.png``) in ``-o`` (default ``<dir>/summary``, or ``./trace_summary`` when ``<dir>``
is not writable).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.trace.reader import TraceDir, find_trace_dirs
from orchestrator.trace.recorder import read_spans, spans_path


def tail(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, float)
    p50 = float(np.percentile(a, 50))
    return {"n": float(len(a)), "mean": float(a.mean()), "p50": p50,
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "max/p50": float(a.max() / p50) if p50 else float("nan")}


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


@dataclass
class TaskSummary:
    name: str
    path: Path
    inputs: list[float] = field(default_factory=list)
    outputs: list[float] = field(default_factory=list)
    turns: Counter[int] = field(default_factory=Counter)
    tool_calls: Counter[int] = field(default_factory=Counter)
    tool_latency: list[float] = field(default_factory=list)
    tool_status: Counter[str] = field(default_factory=Counter)
    stages: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    idle: list[float] = field(default_factory=list)  # engine idle fraction per step / run
    tail_share: list[float] = field(default_factory=list)  # share of a step in its long tail
    notes: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    @property
    def failure_rate(self) -> float:
        total = sum(self.tool_status.values())
        return (total - self.tool_status.get("success", 0)) / total if total else 0.0


def summarize_dir(trace: TraceDir, name: str) -> TaskSummary:
    s = TaskSummary(name, trace.path)
    for step in trace.steps("multiturn_workload"):
        s.steps.append(step)
        generating: list[tuple[float, float]] = []
        makespan = 0.0
        for r in trace.workload(step):
            s.inputs.append(r.prompt_len)
            s.outputs.append(r.final_response_loss_len)
            s.turns[r.turn_count] += 1
            s.tool_calls[r.tool_call_count] += 1
            tools_by_turn: dict[int, float] = defaultdict(float)
            for c in r.tool_calls:
                s.tool_latency.append(c.latency_s)
                s.tool_status[c.status] += 1
                s.stages["tool (trace)"] += c.latency_s
                tools_by_turn[c.turn] += c.latency_s
            t = 0.0
            for turn in r.turns:
                s.stages["generate (trace)"] += turn.engine_latency_s
                generating.append((t, t + turn.engine_latency_s))
                t += turn.engine_latency_s + tools_by_turn.get(turn.turn, 0.0)
            makespan = max(makespan, t)
        if makespan > 0 and any(e > b for b, e in generating):  # no engine time: no idle figure
            s.idle.append(1.0 - union_length(generating) / makespan)
            s.tail_share.append(tail_share(generating, makespan))
    for step in trace.steps("packed_lengths") if not s.steps else ():  # workloads say more
        s.steps.append(step)
        for p in trace.packed_lengths(step):
            s.inputs += [p.input] * len(p.output)
            s.outputs += list(p.output)
    for step in trace.steps("reward_timings"):
        for rt in trace.reward_timings(step):
            s.stages["reward (trace)"] += rt.reward_time_s
    spans = spans_path(trace.path)
    if spans.exists():  # a run directory: the recorder's stages, and the run's idle share
        for k in [k for k in s.stages if k.endswith("(trace)")]:
            del s.stages[k]
        s.idle = []
        generating, start, end = [], float("inf"), 0.0
        for span in read_spans(spans):  # a line cut short by a crash is skipped
            if span.stage in ("warm_start", "rollout"):  # rollout: a group's container span
                continue
            s.stages[span.stage] += span.end - span.start
            if span.stage == "generate":
                generating.append((span.start, span.end))
            if span.stage in ("rollout", "train_step", "generate"):
                start, end = min(start, span.start), max(end, span.end)
        if generating and end > start:
            s.idle.append(1.0 - union_length(generating) / (end - start))
            s.tail_share.append(tail_share(generating, end - start, start))
    if trace.task_distribution is not None:
        from orchestrator.trace.reader import read_task_distribution

        dist = read_task_distribution(trace.task_distribution)
        shape, loc, scale = dist.math_lognorm("output")
        counts = dist.call_count_histogram()
        total = sum(counts.values())
        s.notes.append(f"task distribution {dist.version}: math output lognorm(s={shape:.3f}, "
                       f"loc={loc:.0f}, scale={scale:.0f}), median {loc + scale:.0f} tokens; "
                       f"tool calls per session: " + " ".join(
                           f"{k}:{v / total:.1%}" for k, v in counts.items()))
    return s


def tail_share(intervals: list[tuple[float, float]], span: float, origin: float = 0.0) -> float:
    """Share of ``span`` during which fewer than 10% of the peak number of requests were in
    flight: the long tail in which a batched engine runs nearly empty."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level, peak, low, last = 0, 0, 0.0, origin
    levels = []
    for t, d in events:
        levels.append((last, t, level))
        level += d
        peak = max(peak, level)
        last = t
    levels.append((last, origin + span, level))
    low = sum(b - a for a, b, n in levels if n < 0.1 * peak)
    return low / span if span > 0 else 0.0


def _fmt(stats: dict[str, float]) -> str:
    if not stats:
        return "-"
    return (f"n={int(stats['n'])} p50={stats['p50']:.0f} p90={stats['p90']:.0f} "
            f"p99={stats['p99']:.0f} max={stats['max']:.0f} max/p50={stats['max/p50']:.1f}")


def report(s: TaskSummary) -> str:
    lines = [f"== {s.name} ({s.path}) steps={s.steps}", *[f"  {n}" for n in s.notes]]
    if not s.inputs:
        return "\n".join(lines)
    lines.append(f"  input tokens : {_fmt(tail(s.inputs))}")
    lines.append(f"  output tokens: {_fmt(tail(s.outputs))}")
    if s.turns:
        total = sum(s.turns.values())
        lines.append("  turns/trajectory: " + " ".join(
            f"{k}:{v / total:.1%}" for k, v in sorted(s.turns.items())))
        lines.append("  tool calls/trajectory: " + " ".join(
            f"{k}:{v / total:.1%}" for k, v in sorted(s.tool_calls.items())))
    if s.tool_latency:
        t = tail(s.tool_latency)
        lines.append(f"  tool latency s: p50={t['p50']:.3f} p90={t['p90']:.3f} p99={t['p99']:.3f} "
                     f"max={t['max']:.3f}; failure rate {s.failure_rate:.2%} "
                     f"({dict(s.tool_status)})")
    if sum(s.stages.values()) > 0:  # a generated workload records no engine time
        total = sum(s.stages.values())
        lines.append("  stage time (summed over concurrent spans): " + ", ".join(
            f"{k} {v:.1f} s ({v / total:.1%})" for k, v in sorted(s.stages.items(), key=lambda kv: -kv[1])))
    if s.idle:
        lines.append(f"  engine idle fraction: {np.mean(s.idle):.1%} "
                     f"(per step: {', '.join(f'{x:.1%}' for x in s.idle)}); long tail (<10% of "
                     f"peak requests in flight): {np.mean(s.tail_share):.1%} of the time")
    return "\n".join(lines)


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write and close a figure; its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot(summaries: list[TaskSummary], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []

    summaries = [s for s in summaries if s.inputs]
    n = len(summaries)
    if not n:
        return files
    fig, axes = plt.subplots(n, 2, figsize=(10, 2.8 * n), squeeze=False)
    for row, s in zip(axes, summaries, strict=True):
        for ax, values, label in ((row[0], s.inputs, "input"), (row[1], s.outputs, "output")):
            data = np.asarray([v for v in values if v > 0], float)
            if len(data):
                wide = data.max() > 3 * data.min()  # log scale only for a wide range
                bins = (np.logspace(np.log10(data.min()), np.log10(data.max() + 1), 40) if wide
                        else np.linspace(data.min(), data.max() + 1, 40))
                ax.hist(data, bins=bins)
                if wide:
                    ax.set_xscale("log")
                for q, style in ((50, "-"), (99, "--")):
                    ax.axvline(np.percentile(data, q), color="k", linestyle=style, linewidth=0.8)
            ax.set_title(f"{s.name}: {label} tokens (p50 solid, p99 dashed)", fontsize=9)
    files.append(_save(fig, out / "lengths.png"))

    multi = [s for s in summaries if s.turns]
    if multi:
        fig, axes = plt.subplots(len(multi), 2, figsize=(10, 2.6 * len(multi)), squeeze=False)
        for row, s in zip(axes, multi, strict=True):
            for ax, counts, label in ((row[0], s.turns, "turns"), (row[1], s.tool_calls, "tool calls")):
                keys = sorted(counts)
                ax.bar([str(k) for k in keys], [counts[k] for k in keys])
                ax.set_title(f"{s.name}: {label} per trajectory", fontsize=9)
        files.append(_save(fig, out / "structure.png"))

    tools = [s for s in summaries if s.tool_latency]
    if tools:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for s in tools:
            x = np.sort(np.maximum(np.asarray(s.tool_latency, float), 1e-5))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{s.name} (fail {s.failure_rate:.1%})")
        ax.set_xscale("log")
        ax.set_xlabel("tool latency (s)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=8)
        files.append(_save(fig, out / "tool_latency.png"))

    staged = [s for s in summaries if s.stages]
    if staged:
        fig, ax = plt.subplots(figsize=(8, 0.8 + 0.6 * len(staged)))
        names = sorted({k for s in staged for k in s.stages})
        left = np.zeros(len(staged))
        for stage in names:
            shares = np.array([s.stages.get(stage, 0.0) / sum(s.stages.values()) for s in staged])
            ax.barh([s.name for s in staged], shares, left=left, label=stage)
            left += shares
        ax.set_xlabel("share of recorded stage time")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        files.append(_save(fig, out / "stages.png"))
    return files


def summarize(root: Path | str, out: Path | None = None, plots: bool = True) -> list[TaskSummary]:
    root = Path(root)
    traces = find_trace_dirs(root)
    if not traces:
        raise FileNotFoundError(f"{root} holds no PolyTrace files (see orchestrator.trace)")
    summaries = []
    for trace in traces:
        name = trace.path.name if trace.path != root or not root.name else root.name
        summary = summarize_dir(trace, name)
        summaries.append(summary)
        print(report(summary))
    if plots:
        if out is None:
            out = root / "summary" if os.access(root, os.W_OK) else Path("trace_summary")
        for path in plot(summaries, out):
            print(f"plot: {path}")
    return summaries
