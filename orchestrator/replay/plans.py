"""Episode plans from a PolyTrace workload: what a replay plays.

A plan (:class:`envs.replay.EpisodePlan`) is one recorded trajectory: its prompt length, and
per turn the prompt, cached and completion tokens and the tool calls that follow. Plans keep
their prompt group, so a replayed step trains the recorded groups. :func:`load_plans` reads the
steps a replay asks for, keeps the groups GRPO can batch (:func:`complete_groups`) and scales
a sample up to a full step's load (:func:`resample_groups`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

from envs.replay import EpisodePlan, ToolPlan, TurnPlan
from orchestrator.errors import ConfigError
from orchestrator.trace.reader import SHIPPED_SAMPLE, TraceDir
from orchestrator.trace.records import WorkloadRecord

log = logging.getLogger(__name__)


def open_trace(path: Path | str | None) -> TraceDir:
    """The trace ``trace=`` names (None: the shipped sample), with a multi-turn workload."""
    path = path or SHIPPED_SAMPLE
    try:
        trace = TraceDir.open(path)
    except FileNotFoundError as e:
        raise ConfigError(f"trace={path}: no such directory; point trace= at a PolyTrace "
                          f"directory (multiturn_workload_step_N.jsonl files)") from e
    if not trace.steps():
        raise ConfigError(f"trace={path} holds no multiturn_workload_step_N.jsonl files")
    return trace


def plans_from_records(records: Sequence[WorkloadRecord], first_key: int = 0,
                       group_offset: int = 0) -> list[EpisodePlan]:
    plans = []
    groups: dict[tuple[int, int], int] = {}
    for i, r in enumerate(records):
        group = groups.setdefault((r.step, r.prompt_group_id), group_offset + len(groups))
        tools: dict[int, list[ToolPlan]] = {}
        for c in r.tool_calls:
            tools.setdefault(c.turn, []).append(
                ToolPlan(c.latency_s, c.status, c.query_count, c.append_len))
        turns = tuple(TurnPlan(t.prompt_tokens, t.cached_tokens, t.completion_tokens,
                               t.finish_reason, t.engine_latency_s, tuple(tools.get(t.turn, ())))
                      for t in r.turns)
        plans.append(EpisodePlan(first_key + i, r.prompt_len, turns, group, r.sample_id))
    return plans


def resample_groups(plans: Sequence[EpisodePlan], groups: int, seed: int = 0) -> list[EpisodePlan]:
    """``groups`` prompt groups drawn from those of ``plans`` (with replacement once they run
    out), with fresh keys: scales a sample up to a full step's load."""
    by_group: dict[int, list[EpisodePlan]] = {}
    for p in plans:
        by_group.setdefault(p.group, []).append(p)
    names = sorted(by_group)
    rng = random.Random(seed)
    # Fewer groups: a random subset; more: every group the same number of times (round robin).
    order = rng.sample(names, groups) if groups <= len(names) else [
        names[i % len(names)] for i in range(groups)]
    out = []
    for g, name in enumerate(order[:groups]):
        for p in by_group[name]:
            out.append(EpisodePlan(len(out), p.prompt_tokens, p.turns, g, p.sample))
    return out


def load_plans(trace: TraceDir, steps: Sequence[int] | None, groups_per_step: int | None,
               seed: int) -> tuple[list[EpisodePlan], int]:
    """The plans of ``steps`` (all by default) in order, and the prompt groups per step."""
    steps = list(steps) if steps else trace.steps()
    missing = [s for s in steps if s not in trace.steps()]
    if missing:
        raise ConfigError(f"replay.steps: {trace.path} has no multi-turn workload for steps "
                          f"{missing} (it has {trace.steps()})")
    plans: list[EpisodePlan] = []
    for s in steps:
        step_plans = complete_groups(plans_from_records(list(trace.workload(s)), group_offset=0))
        if not step_plans:
            continue
        if groups_per_step:
            step_plans = resample_groups(step_plans, groups_per_step, seed + s)
        base = len({p.group for p in plans})
        plans += [EpisodePlan(len(plans) + i, p.prompt_tokens, p.turns, base + p.group, p.sample)
                  for i, p in enumerate(step_plans)]
    size = max(sum(1 for p in plans if p.group == g) for g in {p.group for p in plans})
    plans = complete_groups(plans, size)  # steps agree on the group size
    plans = [EpisodePlan(i, p.prompt_tokens, p.turns, p.group, p.sample)
             for i, p in enumerate(plans)]
    per_step = groups_per_step or max(1, len({p.group for p in plans}) // len(steps))
    return plans, per_step


def complete_groups(plans: Sequence[EpisodePlan], size: int | None = None) -> list[EpisodePlan]:
    """The plans of groups with ``size`` samples (default: the most common size): a partial
    step (search_r1's step 5) has groups cut short, which GRPO batches cannot mix."""
    sizes: dict[int, int] = {}
    for p in plans:
        sizes[p.group] = sizes.get(p.group, 0) + 1
    if not sizes:
        return []
    size = size or max(set(sizes.values()), key=list(sizes.values()).count)
    kept = [p for p in plans if sizes[p.group] == size]
    if len(kept) < len(plans):
        log.info("replay: %d trajectories of incomplete groups left out", len(plans) - len(kept))
    return kept
