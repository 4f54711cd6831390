"""What the agent gateway adds to each model call: the same episodes as agent programs over
HTTP and as an in-process ``ToolEnv``.

``python -m bench.gateway [--episodes 256] [--calls 4] [--seconds-per-call 1.0] [--processes 2]``

Both runs drive the simulated engine with one fixed timing: every call takes
``--seconds-per-call`` (a length of ``TOKENS`` tokens at the matching per-token cost) and
its tokens are a Hermes call of a no-op tool, so each episode makes exactly ``--calls`` calls:

* **ToolEnv**: an :class:`EpisodeRunner` episode on a ``ToolEnv`` with the tool, ``rollout.max_turns = calls``;
  a call's latency is its ``generate`` span (the engine call, in process).
* **gateway**: an agent program with an ``openai.AsyncOpenAI`` client (``--client aiohttp``:
  a bare aiohttp client instead) offers the tool, runs each call it gets back and asks again;
  a call's latency is what the program sees around ``chat.completions.create``: rendering,
  HTTP, JSON, parsing, and the same engine call.

A few episodes first warm each process up (the client's first call imports and builds its
types; not measured). Episodes start spread over one call's time (seeded), so the engines see a steady load, not
one burst. The added latency per call is the difference of the two distributions' p50 (and
p99). A third run, **null endpoint**, splits it: the same programs against an aiohttp server
that waits the same engine time and answers the same call with a fixed body, so what it adds
is the client's and HTTP's own cost (the floor under any OpenAI-compatible endpoint; the
openai SDK alone spends milliseconds of CPU per call), and the rest is the gateway's. No
episode may be lost: every one must finish with all its calls recorded as one segment. The gateway and the engine share the run's event loop; the programs run in
``--processes`` worker processes (``env.processes``, default 2 here), or in that loop too with
``--processes 0``.

The headline is measured in the gateway itself, not as a difference of two distributions of
second-long calls (which moved by milliseconds from run to run): each call's
``gateway_call`` span runs from reading the request's body to its response built, and its
``engine_s`` is the part spent waiting on the engine, so the gateway's own time per call is
the span less ``engine_s``: parsing, rendering the prompt, building the reply. The
client-side figures above stay as context (what the program sees, HTTP included).
Last line: ``gateway_overhead_p50_ms=<ms>``, that own time's p50 (target <= 2).

``--smoke`` (the tests', seconds): 8 episodes of 2 calls of 50 ms, the programs in the run's
event loop (``--processes 0``: worker processes would cost their start-up); every other
option given overrides it. It checks the bench runs end to end; its figures say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import anyio
from aiohttp import web

from bench.cli import add_smoke, headline
from envs.agent import AgentEndpoint, AgentSpec
from envs.base import Env, EnvSpec, Reward, Task
from envs.parsers import HermesParser
from envs.tool_env import ToolEnv
from envs.tools import tool
from envs.toolset import ToolSet
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.gateway import Gateway, GatewayConfig, run_agent_episode
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.trace.recorder import Recorder
from orchestrator.types import Generation, SamplingParams

TOK = CharTokenizer()
CALL = HermesParser.format("noop", {})
TOKENS = len(CALL) + 1  # the call and its stop token
SMOKE = {"episodes": 8, "calls": 2, "seconds_per_call": 0.05, "processes": 0}
FULL = {"episodes": 256, "calls": 4, "seconds_per_call": 1.0, "processes": 2}
TOOL = {"type": "function", "function": {"name": "noop", "description": "Do nothing.",
                                         "parameters": {"type": "object", "properties": {}}}}


class CallingEngine(SimulatedEngine):
    """The simulated engine's timing, with every generation a call of the no-op tool."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        gen = await super().generate(prompt_ids, replace(sampling, max_tokens=TOKENS))
        ids = (*TOK.encode(CALL), sampling.stop_token_ids[0])
        return replace(gen, token_ids=ids, logprobs=(-1.0,) * len(ids),
                       versions=(gen.versions[0],) * len(ids))


@tool
async def noop() -> str:
    """Do nothing."""
    return "ok"


async def _one(_episode: Any) -> Reward:
    return Reward(1.0)


class NoopSpec(EnvSpec):
    def __init__(self, episodes: int) -> None:
        self._tasks = [Task(id=i, messages=({"role": "user", "content": f"task {i}"},), answer="")
                       for i in range(episodes)]

    def tasks(self, split: str) -> Sequence[Task]:
        return self._tasks

    def make_env(self) -> Env:
        return ToolEnv(ToolSet([noop], clock=self.clock), _one,
                       describe_tools=False)


def _engine(seconds_per_call: float, seed: int) -> CallingEngine:
    return CallingEngine(median_tokens=TOKENS, sigma=0.0, chunk_tokens=TOKENS,
                         seconds_per_token=seconds_per_call / TOKENS, seed=seed)


async def _staggered(episodes: int, spread: float, seed: int, body: Any) -> float:
    """Run ``body(i)`` for every episode, each starting at a seeded offset within ``spread``;
    the wall time of it all."""
    offsets = random.Random(seed).sample(range(10**6), episodes)
    started = time.perf_counter()

    async def one(i: int) -> None:
        await anyio.sleep(offsets[i] / 10**6 * spread)
        await body(i)

    async with anyio.create_task_group() as tg:
        for i in range(episodes):
            tg.start_soon(one, i)
    return time.perf_counter() - started


async def run_tool_env(episodes: int, calls: int, seconds: float, seed: int) -> dict[str, Any]:
    spec, recorder = NoopSpec(episodes), Recorder()
    spec.use_clock(recorder.clock)
    rollout = RolloutConfig(group_size=1, max_tokens=TOKENS, max_turns=calls)
    engine = _engine(seconds, seed)
    runner = EpisodeRunner(engine, TOK, spec, rollout, recorder)
    finished: list[int] = []

    async def body(i: int) -> None:
        _, timing = await runner.episode(spec.tasks("train")[i], "w", i)
        finished.append(len(timing.turns))

    wall = await _staggered(episodes, seconds, seed, body)
    latencies = [s.duration for s in recorder.of("generate")]
    return {"latencies": latencies, "finished": finished, "wall": wall}


# What the programs read (a program gets only its task and client, as a user's does): the calls
# per episode come in each task's metadata, so programs in worker processes read them too.
PROGRAM: dict[str, Any] = {"session": None}  # a process's one aiohttp session, for agent_aiohttp


def noop_tasks(split: str) -> list[Task]:
    episodes, calls = (int(v) for v in os.environ.get("BENCH_GATEWAY", "256,4").split(","))
    return [replace(t, metadata={"calls": calls}) for t in NoopSpec(episodes).tasks(split)] \
        if split == "train" else []


def _latencies(latencies: list[float]) -> Reward:
    """Reward 1 with each call's latency as a component: how the numbers come back from a
    program in a worker process."""
    return Reward(1.0, {f"call{i}_s": v for i, v in enumerate(latencies)})


async def agent(task: Task, client: Any) -> float:
    """The agent program: offer the tool, run every call that comes back, ask again."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    latencies: list[float] = []
    for _ in range(task.metadata["calls"]):
        started = time.perf_counter()
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        tools=[TOOL])
        latencies.append(time.perf_counter() - started)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "ok"}
                     for c in message.tool_calls or []]
    return _latencies(latencies)


async def agent_aiohttp(task: Task, client: Any) -> float:
    """The same program on a bare aiohttp client (the openai client gives the URL and key)."""
    if PROGRAM["session"] is None:
        PROGRAM["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    session: aiohttp.ClientSession = PROGRAM["session"]
    url, headers = f"{client.base_url}chat/completions", {"Authorization": f"Bearer {client.api_key}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    latencies: list[float] = []
    for _ in range(task.metadata["calls"]):
        started = time.perf_counter()
        async with session.post(url, headers=headers, json={
                "model": "policy", "messages": messages, "tools": [TOOL]}) as response:
            message = (await response.json())["choices"][0]["message"]
        latencies.append(time.perf_counter() - started)
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"}
                     for c in message.get("tool_calls") or []]
    return _latencies(latencies)


def _agent_spec(episodes: int, calls: int, client: str, processes: int) -> AgentSpec:
    os.environ["BENCH_GATEWAY"] = f"{episodes},{calls}"  # noop_tasks', here and in the workers
    program = "bench.gateway:agent" if client == "openai" else "bench.gateway:agent_aiohttp"
    return AgentSpec(program=program, tasks="bench.gateway:noop_tasks", timeout_s=600,
                     processes=processes)


async def _close_session() -> None:
    """The aiohttp client's session, when agent_aiohttp ran in this process."""
    if PROGRAM["session"] is not None:
        await PROGRAM["session"].close()
        PROGRAM["session"] = None


async def run_gateway(episodes: int, calls: int, seconds: float, seed: int,
                      client: str, processes: int = 0) -> dict[str, Any]:
    engine = _engine(seconds, seed)
    rollout = RolloutConfig(group_size=1, max_tokens=TOKENS)
    finished: list[tuple[int, int, str]] = []
    latencies: list[float] = []
    spec = _agent_spec(episodes, calls, client, processes)
    recorder = Recorder()
    async with spec.running(), \
            Gateway(engine, TOK, recorder, GatewayConfig(max_calls=calls)) as gateway:

        async def body(i: int) -> None:
            trajectories, outcome = await run_agent_episode(
                gateway, spec, spec.tasks("train")[i], rollout, "w", i)
            finished.append((len(trajectories), sum(len(e.turns) for _, e in trajectories),
                             outcome.error or outcome.status))
            latencies.extend(outcome.reward.components.values())

        # warm-up, not measured: each process's first calls import and build the client's types
        async with anyio.create_task_group() as tg:
            for i in range(2 * max(processes, 1)):
                tg.start_soon(run_agent_episode, gateway, spec, spec.tasks("train")[i], rollout,
                              "warm-up", i)
        before = gateway.metrics()
        warm = len(recorder.spans)
        wall = await _staggered(episodes, seconds, seed, body)
        counters = {k: v - before.get(k, 0.0) for k, v in gateway.metrics().items()}
    await _close_session()
    # the gateway's own time per call, measured where it is spent: each call's span less its
    # wait on the engine
    own = [s.duration - s.attributes["engine_s"] for s in recorder.spans[warm:]
           if s.stage == "gateway_call"]
    return {"latencies": latencies, "finished": finished, "wall": wall, "counters": counters,
            "own": own}


async def run_null(episodes: int, calls: int, seconds: float, seed: int, client: str,
                   processes: int) -> dict[str, Any]:
    """The same programs, processes and timing against a null endpoint: an aiohttp server that
    waits the call's engine time and answers the same tool call with a fixed body. What this
    adds over the engine time is the client's and HTTP's own cost, the floor under any
    OpenAI-compatible endpoint."""
    body = json.dumps({
        "id": "chatcmpl-null", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": "call_0", "type": "function",
                "function": {"name": "noop", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": TOKENS, "total_tokens": TOKENS + 1}})

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        await anyio.sleep(seconds)
        return web.Response(text=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    endpoint = AgentEndpoint(f"http://127.0.0.1:{port}/v1/", "sk-null", "policy")
    spec = _agent_spec(episodes, calls, client, processes)
    latencies: list[float] = []
    try:
        async with spec.running():
            async with anyio.create_task_group() as tg:  # warm-up, as for the gateway
                for i in range(2 * max(processes, 1)):
                    tg.start_soon(spec.run_episode, spec.tasks("train")[i], endpoint)

            async def one(i: int) -> None:
                outcome = await spec.run_episode(spec.tasks("train")[i], endpoint)
                latencies.extend(outcome.reward.components.values())

            await _staggered(episodes, seconds, seed, one)
    finally:
        await runner.cleanup()
        await _close_session()
    return {"latencies": latencies}


def _quantile(values: Sequence[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=None, help="256 (--smoke 8)")
    parser.add_argument("--calls", type=int, default=None, help="calls per episode: 4 (--smoke 2)")
    parser.add_argument("--seconds-per-call", type=float, default=None, help="1.0 (--smoke 0.05)")
    parser.add_argument("--client", choices=["openai", "aiohttp"], default="openai")
    parser.add_argument("--processes", type=int, default=None,
                        help="env.processes: worker processes the programs run in (0: in the "
                             "run's event loop, with the gateway and the engine): 2 (--smoke 0)")
    parser.add_argument("--seed", type=int, default=0)
    add_smoke(parser)
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():  # what the command line leaves out
        if getattr(args, key) is None:
            setattr(args, key, value)
    n, calls, seconds = args.episodes, args.calls, args.seconds_per_call

    base = anyio.run(run_tool_env, n, calls, seconds, args.seed)
    gate = anyio.run(run_gateway, n, calls, seconds, args.seed, args.client, args.processes)
    null = anyio.run(run_null, n, calls, seconds, args.seed, args.client, args.processes)
    ok = [f for f in gate["finished"] if f == (1, calls, "ok")]
    lost = n - len(ok)
    if len(base["finished"]) != n or any(t != calls for t in base["finished"]):
        raise SystemExit(f"the ToolEnv run lost episodes: {base['finished']}")
    print(json.dumps({"episodes": n, "calls_per_episode": calls, "seconds_per_call": seconds,
                      "client": args.client, "processes": args.processes, "counters": gate["counters"],
                      "wall_s": {"tool_env": round(base["wall"], 3),
                                 "gateway": round(gate["wall"], 3)}}))
    rows = []
    for q in (0.5, 0.99):
        a, b = _quantile(base["latencies"], q), _quantile(gate["latencies"], q)
        c = _quantile(null["latencies"], q)
        rows.append((q, a, b, b - a))
        print(f"p{round(q * 100)}: ToolEnv {a * 1e3:8.2f} ms   gateway {b * 1e3:8.2f} ms   "
              f"added {(b - a) * 1e3:6.2f} ms per call; null endpoint {c * 1e3:8.2f} ms: "
              f"the client and HTTP {(c - a) * 1e3:6.2f} ms, the gateway {(b - c) * 1e3:6.2f} ms")
    print(f"episodes lost: {lost} of {n} (every call recorded: "
          f"{gate['counters'].get('agent/calls', 0):.0f} of {n * calls})")
    if lost:
        raise SystemExit(f"lost episodes: {[f for f in gate['finished'] if f != (1, calls, 'ok')][:5]}")
    own = gate["own"]
    print(f"the gateway's own time per call, server-side ({len(own)} calls: from the request's "
          f"body to its response, less the engine's time): p50 {_quantile(own, 0.5) * 1e3:.2f} "
          f"ms, p99 {_quantile(own, 0.99) * 1e3:.2f} ms, max {max(own) * 1e3:.2f} ms")
    print(f"gateway_overhead_p99_ms={_quantile(own, 0.99) * 1e3:.2f}")
    headline("gateway_overhead_p50_ms", _quantile(own, 0.5) * 1e3, 2)


if __name__ == "__main__":  # run as bench.gateway, the module the agent env imports the programs from
    from bench.gateway import main as imported_main

    imported_main()
