"""Engine throughput under a multi-turn agentic workload: the torch engine's continuous
batching against its static waves.

Workload. ``CLIENTS`` = 64 concurrent clients run episodes drawn (seeded, with replacement)
from the PolyTrace search_r1 sample this project ships (``orchestrator/trace/data/search_r1``:
256 trajectories of 1-5 turns). An episode keeps its trajectory's shape: the prompt length,
each turn's completion length, and the tool calls after each turn. Lengths are multiplied
by ``LENGTH_SCALE`` = 1/5 (rounded, at least one token), so that the trajectories' prompt
plus completions fit the tiny model's 256-token context: a turn generates 12 tokens at the
median, 29 at p90, 59 at p99, at most 192; 2 of the 256 trajectories are cut (an episode
whose next turn would not fit ends there, as a rollout does at ``max_length``, and a turn
that would overflow is cut to what fits). Each tool call appends ``OBSERVATION_IDS`` = 4
"observation" ids (the trace's observations, ~530 tokens, would not fit: see Limits) and
pauses its client for a draw from the search latency model fitted to PolyTrace
(``sandboxes.search.latency.TraceFaultModel``, empirical, by the call's query count) times
``--time-scale`` (0.1: 17 ms at the median, 43 ms on average). Each turn is one
``engine.generate``: the conversation so far as prompt ids (token in, token out: the
generated ids are appended, then the observation's), ``max_tokens`` the turn's scaled
length, temperature 1, no stop tokens, so every generated length is the trace's. Prompt and
observation ids are drawn from the seed; every mode runs the same episodes.

Modes (``engine.batching``). ``waves``: static batches, as the engine ran before continuous
batching: a wave takes the requests waiting when it starts, later ones wait for the whole
wave to stop, and its results are handed out together at its end. ``continuous``: requests
join the running batch at the next token and are handed out as soon as they stop. Both run
the same prefill, decode and cache code.

Engine. The tiny policy of ``conf/model/tiny.yaml`` (random weights, as ``tests/helpers.py``
builds engines), ``max_batch_size`` 64, torch threads 1 and glibc's allocator keeping freed
memory (:mod:`orchestrator.allocator`), as the pipeline's engine core runs it. Without the
latter every step's large tensors (logits, the cache's gathers) are mapped and page-faulted
afresh: on SmolLM2 that cost the continuous engine 5.3 s of system time in a 52 s run of 128
episodes (1.3 M page faults, against 44 k kept), 12% of its tokens/s. Reported per mode:
generated tokens per second of wall time, p50/p99 latency of one ``generate`` call (queueing
inside the engine included) and the number of calls.

Adding an engine: append ``(name, factory)`` to the list :func:`engines` returns;
:func:`run_workload` drives any ``InferenceEngine``. Where vLLM is importable
(``.venv-vllm/bin/python -m bench.engine``) a ``vllm`` row runs the same workload through
``engine=vllm`` (its start-up is not timed).

Limits. The tiny model on CPU: a forward pass costs ~2-3 ms of fixed overhead plus compute
per token, so batching more rows per step gains less than on a GPU. Both engines keep a
finished turn's KV cache (the torch engine's ``prefix_cache_tokens``, vLLM's prefix cache):
an episode's next turn feeds only its new tokens, the same work in every mode.
Observations are a few ids, not the trace's hundreds of tokens, which would fill the context.

``--model smollm2``: the same workload on the real SmolLM2-135M-Instruct (``model=smollm2``;
256 episodes, 32 with ``--quick``), its context capped at the tiny model's 256 so the
workload is the same; random ids from its vocabulary.

``--smoke`` (seconds, the tests'): 16 episodes of the same workload on the tiny model, both
modes once (and the vLLM row where vLLM imports); its figures say nothing.

Last line: ``continuous_vs_waves=<tokens/s ratio>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from omegaconf import OmegaConf

from bench.cli import add_smoke, headline
from bench.machine import machine, spread
from orchestrator.allocator import keep_freed_memory
from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import build_policy
from orchestrator.trace.reader import SHIPPED_SAMPLE, TraceDir
from orchestrator.trace.records import ToolCallTrace, WorkloadRecord
from orchestrator.types import SamplingParams
from orchestrator.weights.update import WeightUpdate
from sandboxes.search.latency import TraceFaultModel

TINY = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny.yaml"
CLIENTS = 64
SMOKE_EPISODES = 16
LENGTH_SCALE = 1 / 5
OBSERVATION_IDS = 4  # appended per tool call
FIRST_ID = 7  # ids below are the char tokenizer's specials: prompts hold ordinary characters


@dataclass(frozen=True)
class Turn:
    max_tokens: int
    pause_s: float  # tool time after this turn (0 after the last)
    observation: tuple[int, ...]  # ids the tools append after this turn


@dataclass(frozen=True)
class Episode:
    prompt: tuple[int, ...]
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    episodes: tuple[Episode, ...]
    clients: int

    @property
    def tokens(self) -> int:
        return sum(t.max_tokens for e in self.episodes for t in e.turns)

    @property
    def turns(self) -> int:
        return sum(len(e.turns) for e in self.episodes)


@dataclass(frozen=True)
class Row:
    tokens: int  # generated
    wall_s: float
    latencies_s: tuple[float, ...]  # one per generate call

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3


# -- the workload -----------------------------------------------------------------------------


def scaled(n: int) -> int:
    return max(1, round(n * LENGTH_SCALE))


def episode(record: WorkloadRecord, context: int, vocab: int, latency: TraceFaultModel,
            time_scale: float, rng: random.Random) -> Episode:
    """``record``'s shape at ``LENGTH_SCALE``, cut to ``context`` tokens."""
    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(n))

    calls: defaultdict[int, list[ToolCallTrace]] = defaultdict(list)
    for call in record.tool_calls:
        calls[call.turn].append(call)
    prompt = ids(scaled(record.prompt_len))
    length = len(prompt)
    turns = []
    for i, turn in enumerate(record.turns):
        room = context - length
        if room <= 0:
            break
        max_tokens = min(scaled(turn.completion_tokens), room)
        last = i == len(record.turns) - 1
        observation = () if last else ids(OBSERVATION_IDS * len(calls[turn.turn]))
        pause = 0.0 if last else sum(latency.sample(c.query_count)[0] for c in calls[turn.turn])
        turns.append(Turn(max_tokens, pause * time_scale, observation))
        length += max_tokens + len(observation)
    return Episode(prompt, tuple(turns))


def load_workload(episodes: int, context: int, vocab: int, time_scale: float, seed: int,
                  clients: int = CLIENTS, trace: Path | str | None = None) -> Workload:
    directory = TraceDir.open(trace or SHIPPED_SAMPLE)
    records = [r for step in directory.steps() for r in directory.workload(step) if r.turns]
    rng = random.Random(seed)
    latency = TraceFaultModel("empirical", seed=seed)
    drawn = (rng.choice(records) for _ in range(episodes))
    return Workload(tuple(episode(r, context, vocab, latency, time_scale, rng) for r in drawn),
                    clients)


# -- running it -------------------------------------------------------------------------------


async def run_episode(engine: InferenceEngine, e: Episode, latencies: list[float]) -> int:
    """One episode, turn after turn with its tool pauses; returns the tokens generated."""
    sequence = list(e.prompt)
    generated = 0
    for turn in e.turns:
        started = time.perf_counter()
        sampling = SamplingParams(max_tokens=turn.max_tokens, temperature=1.0)
        gen = await engine.generate(sequence, sampling)
        latencies.append(time.perf_counter() - started)
        generated += len(gen.token_ids)
        sequence += [*gen.token_ids, *turn.observation]
        await anyio.sleep(turn.pause_s)
    return generated


async def run_workload(engine: InferenceEngine, workload: Workload) -> Row:
    """``workload.clients`` clients each taking the next episode until none is left."""
    queue: Iterator[Episode] = iter(workload.episodes)
    latencies: list[float] = []
    tokens: list[int] = []

    async def client() -> None:
        for e in queue:  # shared: each episode runs once
            tokens.append(await run_episode(engine, e, latencies))

    async with engine:  # started first: an engine's start-up (vLLM's ~30 s) is not timed
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(workload.clients):
                tg.start_soon(client)
        elapsed = time.perf_counter() - started
    return Row(sum(tokens), elapsed, tuple(latencies))


# -- engines ----------------------------------------------------------------------------------


def tiny_model(seed: int) -> dict[str, Any]:
    node = OmegaConf.to_container(OmegaConf.load(TINY), resolve=False)
    assert isinstance(node, dict)
    return {**node, "seed": seed}


TINY_CONTEXT = 256


def smollm2_model() -> dict[str, Any]:
    node = OmegaConf.to_container(OmegaConf.load(TINY.parent / "smollm2.yaml"), resolve=False)
    assert isinstance(node, dict)
    return {**node, "device": "cpu"}


def torch_engine(model: Mapping[str, Any], weights: WeightUpdate | None, seed: int,
                 batching: str = "continuous", max_batch_size: int = CLIENTS) -> InferenceEngine:
    return TorchEngine(model, weights, max_batch_size=max_batch_size, seed=seed,
                       batching=batching)


def vllm_engine(model: Mapping[str, Any], weights: WeightUpdate | None, seed: int,
                **options: Any) -> InferenceEngine:
    """``options``: more of ``VLLMEngine``'s (``bench.real_model``: no prefix cache)."""
    from orchestrator.engines.vllm_engine import VLLMEngine

    # CPU: the KV cache in bytes (1 GiB, kv_cache_bytes=auto); eager (no compile) for a quick
    # start. vLLM has a prefix cache: later turns reuse their conversation's KV.
    settings = {"kv_cache_bytes": "auto", "max_num_seqs": CLIENTS,
                "enforce_eager": not torch.cuda.is_available(), "seed": seed, **options}
    return VLLMEngine(model, weights, **settings)


def engines(model: Mapping[str, Any], weights: WeightUpdate,
            seed: int) -> list[tuple[str, Callable[[], InferenceEngine]]]:
    rows = [
        ("waves", partial(torch_engine, model, weights, seed, "waves")),
        ("continuous", partial(torch_engine, model, weights, seed, "continuous")),
    ]
    if importlib.util.find_spec("vllm") is not None:  # .venv-vllm, or the vllm extra
        rows.append(("vllm", partial(vllm_engine, model, weights, seed)))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine",
                                     description="Torch engine: continuous batching against waves.")
    parser.add_argument("--quick", action="store_true", help="fewer episodes")
    add_smoke(parser)
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="multiplies the search latency model's tool pauses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of both modes, alternating (default 3; --quick 1)")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="smollm2: the real SmolLM2-135M-Instruct (model=smollm2), same "
                             "workload shape (its context capped at the tiny model's)")
    args = parser.parse_args(argv)
    kept = keep_freed_memory()  # glibc's allocator as python -m orchestrator sets it
    real = args.model == "smollm2"
    episodes = args.episodes or (SMOKE_EPISODES if args.smoke else (32 if args.quick else 256)
                                 if real else (128 if args.quick else 1024))
    torch.set_num_threads(1)
    model = smollm2_model() if real else tiny_model(args.seed)
    policy = build_policy(model)
    # the real model's 8,192 positions would change the workload; both get the tiny one's cap
    context = min(policy.model.config.max_position_embeddings, TINY_CONTEXT)
    weights = WeightUpdate.of_module(0, policy.model)
    workload = load_workload(episodes, context, policy.tokenizer.vocab_size, args.time_scale,
                             args.seed)
    print(f"workload: {episodes} episodes of the search_r1 sample (seed {args.seed}), "
          f"{workload.clients} clients, {workload.turns} turns, {workload.tokens} tokens to generate")
    print(f"scales: lengths x{LENGTH_SCALE:g} (context {context}), tool pauses "
          f"x{args.time_scale:g} (search latency model, empirical)")
    print(f"engine: torch, {args.model} model on {policy.device}, torch threads "
          f"{torch.get_num_threads()}, max_batch_size {CLIENTS}, freed memory kept: {kept}")
    print(machine())
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    print(f"{'run':<4} {'mode':<11} {'tokens/s':>9} {'p50_ms':>8} {'p99_ms':>8} {'requests':>8}")
    ratios = []
    for run in range(1, repeats + 1):
        rows = {}
        for name, factory in engines(model, weights, args.seed):
            row = anyio.run(run_workload, factory(), workload)
            if row.tokens != workload.tokens:  # no stop tokens: every turn runs to its length
                raise RuntimeError(f"{name}: {row.tokens} tokens generated, "
                                   f"{workload.tokens} expected")
            rows[name] = row
            print(f"{run:<4} {name:<11} {row.tokens_per_s:>9.1f} {row.latency_ms(50):>8.1f} "
                  f"{row.latency_ms(99):>8.1f} {len(row.latencies_s):>8}", flush=True)
        ratios.append(rows["continuous"].tokens_per_s / rows["waves"].tokens_per_s)
    print(f"continuous against waves, tokens/s: {spread(ratios)}")
    headline("continuous_vs_waves", statistics.median(ratios), 2)


if __name__ == "__main__":
    main()
