"""Fitting the server model to PolyTrace steps, and how well a fit replays a step.

The fit (:func:`fit`) replays trace steps closed-loop through the standalone
:class:`~orchestrator.replay.model.ServerModel` (:func:`simulate`): every trajectory's first
turn arrives at 0, each later turn when the previous turn finished plus its recorded tool time.
It searches the parameters with Nelder-Mead on log scale from two starts, minimising makespan
error + median end-to-end error + per-turn latency KS and quantile gap over the fit steps.

:func:`fit_trace` fits the steps of a trace directory and returns an :class:`EngineFit`: the
server parameters and what the trainer cost model is calibrated from (the mean rollout
makespan and token count of those steps). ``python -m orchestrator.replay fit`` saves one; the
fit of the published search_r1 steps 0-2 ships in ``data/`` (:data:`SHIPPED_FIT`).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.errors import ConfigError
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.trace.reader import TraceDir
from orchestrator.trace.records import WorkloadRecord
from orchestrator.trainer.simulated import TokenCost

SHIPPED_FIT = Path(__file__).resolve().parent / "data" / "search_r1_engine.json"


# -- closed-loop replay of trace steps --------------------------------------------------------

@dataclass(frozen=True)
class TurnShape:
    spec: RequestSpec
    latency: float  # recorded engine latency
    tool_seconds: float  # recorded tool time after this turn (0 for the last)


Episode = Sequence[TurnShape]


def simulate(params: ServerParams, episodes: Sequence[Episode]) -> tuple[list[float], list[float]]:
    """Replays episodes that all start at 0; returns (per-turn latencies, per-episode e2e)."""
    server = ServerModel(params)
    latencies: list[float] = []
    e2e = [0.0] * len(episodes)
    submitted: dict[int, tuple[int, int, float]] = {}  # rid -> (episode, turn, arrival)
    arrivals: list[tuple[float, int, int]] = [(0.0, i, 0) for i in range(len(episodes)) if episodes[i]]
    heapq.heapify(arrivals)
    rid = 0
    while arrivals or server.running or server.queue:
        next_arrival = arrivals[0][0] if arrivals else math.inf
        event = server.next_event()
        if event is None and not arrivals:
            break
        if event is not None and event <= next_arrival:
            done = server.advance(event)
        else:
            done = []
            while arrivals and arrivals[0][0] <= next_arrival:
                at, ep, turn = heapq.heappop(arrivals)
                submitted[rid] = (ep, turn, at)
                done += server.submit(at, rid, episodes[ep][turn].spec)
                rid += 1
        for r in done:
            ep, turn, at = submitted.pop(r)
            latencies.append(server.t - at)
            shape = episodes[ep][turn]
            if turn + 1 < len(episodes[ep]):
                heapq.heappush(arrivals, (server.t + shape.tool_seconds, ep, turn + 1))
            else:
                e2e[ep] = server.t + shape.tool_seconds
    return latencies, e2e


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([x, y])
    cdf_x = np.searchsorted(x, grid, side="right") / len(x)
    cdf_y = np.searchsorted(y, grid, side="right") / len(y)
    return float(np.abs(cdf_x - cdf_y).max())


@dataclass(frozen=True)
class Fidelity:
    makespan_error: float  # relative, signed: simulated / observed - 1
    median_e2e_error: float
    latency_ks: float
    makespan: float
    observed_makespan: float

    @property
    def accuracy(self) -> float:
        return 1.0 - abs(self.makespan_error)


def observed(episodes: Sequence[Episode]) -> tuple[list[float], list[float]]:
    lat = [t.latency for ep in episodes for t in ep]
    e2e = [sum(t.latency + t.tool_seconds for t in ep) for ep in episodes]
    return lat, e2e


def fidelity(sim: tuple[list[float], list[float]], obs: tuple[list[float], list[float]]) -> Fidelity:
    (s_lat, s_e2e), (o_lat, o_e2e) = sim, obs
    return Fidelity(
        makespan_error=max(s_e2e) / max(o_e2e) - 1.0,
        median_e2e_error=float(np.median(s_e2e) / np.median(o_e2e) - 1.0),
        latency_ks=ks_statistic(s_lat, o_lat),
        makespan=max(s_e2e),
        observed_makespan=max(o_e2e),
    )


_FREE = ("step_base", "step_per_seq", "step_per_1k_tokens", "prefill_per_1k", "max_running")


def _params(x: np.ndarray, base: ServerParams) -> ServerParams:
    values = np.exp(x)
    kwargs = {k: float(v) for k, v in zip(_FREE, values, strict=True)}
    kwargs["max_running"] = max(1, round(kwargs["max_running"]))
    return replace(base, **kwargs)


def replay_fidelity(params: ServerParams, episodes: Sequence[Episode], replicas: int = 1) -> Fidelity:
    """Simulate ``episodes`` (each played ``replicas`` times) against what was recorded."""
    return fidelity(simulate(params, list(episodes) * replicas), observed(episodes))


_QUANTILES = np.linspace(0.02, 0.98, 49)


def _loss(params: ServerParams, steps: Sequence[Sequence[Episode]], replicas: int = 1) -> float:
    """Makespan and median errors, the latency KS, and the RMS gap of log-latency quantiles
    (smooth where KS is not, so the search can follow it)."""
    total = 0.0
    for episodes in steps:
        sim = simulate(params, list(episodes) * replicas)
        obs = observed(episodes)
        f = fidelity(sim, obs)
        gap = np.log(np.quantile(sim[0], _QUANTILES)) - np.log(np.quantile(obs[0], _QUANTILES))
        total += (2.0 * abs(f.makespan_error) + abs(f.median_e2e_error) + 2.0 * f.latency_ks
                  + float(np.sqrt(np.mean(gap ** 2))))
    return total / len(steps)


def nelder_mead(f, x0: np.ndarray, scale: float = 0.5, iterations: int = 200, tol: float = 1e-4):
    n = len(x0)
    simplex = [x0] + [x0 + scale * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = int(np.argmin(values))
    return simplex[i], values[i]


# Where the search starts: shares of the turn-0 per-token time given to the per-request and
# per-resident-token terms, and to prefill. The loss has several basins (batch-bound against
# context-bound decoding); the fit runs from each start and keeps the best.
STARTS = ((0.3, 0.3, 0.25), (0.2, 0.6, 0.5))


def initial_guess(steps: Sequence[Sequence[Episode]], seq_share: float = 0.3,
                  token_share: float = 0.3, prefill_share: float = 0.25) -> ServerParams:
    """A start from the trace itself: turn-0 latency per token under the full first batch."""
    episodes = steps[0]
    first = [ep[0] for ep in episodes if ep]
    per_token = float(np.median([t.latency / max(t.spec.completion_tokens, 1) for t in first]))
    batch = len(first)
    return ServerParams(step_base=0.05 * per_token, step_per_seq=seq_share * per_token / batch,
                        step_per_1k_tokens=token_share * per_token / batch,
                        prefill_per_1k=prefill_share * per_token, max_running=batch)


def fit(steps: Sequence[Sequence[Episode]], iterations: int = 90,
        start: ServerParams | None = None, replicas: int = 1) -> tuple[ServerParams, float]:
    """Nelder-Mead on log parameters from each of :data:`STARTS` (or from ``start``)."""
    starts = [start] if start else [initial_guess([list(steps[0]) * replicas], *s) for s in STARTS]
    best: tuple[ServerParams, float] | None = None
    for base in starts:
        x0 = np.log([getattr(base, k) for k in _FREE])
        x, value = nelder_mead(lambda x, base=base: _loss(_params(x, base), steps, replicas), x0,
                               iterations=iterations)
        if best is None or value < best[1]:
            best = (_params(x, base), value)
    assert best is not None
    return best


def episodes_from(records: Iterable[WorkloadRecord]) -> list[list[TurnShape]]:
    """Turn shapes of PolyTrace workload records."""
    out = []
    for r in records:
        tool: dict[int, float] = {}
        for c in r.tool_calls:
            tool[c.turn] = tool.get(c.turn, 0.0) + c.latency_s
        out.append([TurnShape(RequestSpec(t.prompt_tokens, t.cached_tokens, t.completion_tokens),
                              t.engine_latency_s, tool.get(t.turn, 0.0)) for t in r.turns])
    return out


# -- what a fit saves -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineFit:
    """What ``python -m orchestrator.replay fit`` saves."""

    server: ServerParams
    makespan_s: float  # mean observed rollout makespan of the fit steps
    tokens_per_step: float  # mean total tokens (prompt + response) per fit step
    trajectories_per_step: float
    source: str = ""
    steps: tuple[int, ...] = ()
    loss: float = 0.0

    def train_cost(self, rollout_share: float = 0.7) -> TokenCost:
        """The trainer cost model that makes rollout ``rollout_share`` of a synchronous step."""
        if not 0.0 < rollout_share < 1.0:
            raise ConfigError(f"replay.rollout_share={rollout_share} must be between 0 and 1")
        train_seconds = self.makespan_s * (1.0 - rollout_share) / rollout_share
        return TokenCost(per_token_s=train_seconds / self.tokens_per_step)

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server.to_dict(), "makespan_s": self.makespan_s,
                "tokens_per_step": self.tokens_per_step,
                "trajectories_per_step": self.trajectories_per_step, "source": self.source,
                "steps": list(self.steps), "loss": self.loss}

    @classmethod
    def load(cls, path: Path | str | None = None) -> EngineFit:
        path = Path(path) if path else SHIPPED_FIT
        try:
            data = json.loads(path.read_text())
            return cls(ServerParams(**data["server"]), float(data["makespan_s"]),
                       float(data["tokens_per_step"]), float(data["trajectories_per_step"]),
                       str(data.get("source", "")), tuple(data.get("steps", ())),
                       float(data.get("loss", 0.0)))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"replay.engine={path} is not an engine fit saved by "
                              f"`python -m orchestrator.replay fit` ({e})") from e


def fit_trace(trace_dir: Path | str, steps: Sequence[int] | None = None,
              iterations: int = 90, replicas: int = 1) -> EngineFit:
    """Fit on ``steps`` of ``trace_dir`` (all by default). ``replicas`` > 1 plays every
    trajectory that many times, to rebuild a full step's load from a sample of it."""
    trace = TraceDir.open(trace_dir)
    steps = list(steps) if steps is not None else trace.steps()
    records = {s: list(trace.workload(s)) for s in steps}
    episodes = [episodes_from(records[s]) for s in steps]
    params, loss = fit(episodes, iterations=iterations, replicas=replicas)
    return EngineFit(
        server=params,
        makespan_s=float(np.mean([max(r.end_to_end_s for r in records[s]) for s in steps])),
        tokens_per_step=float(np.mean([sum(r.final_total_len for r in records[s])
                                       for s in steps])) * replicas,
        trajectories_per_step=float(np.mean([len(records[s]) for s in steps])) * replicas,
        source=str(trace.path), steps=tuple(steps), loss=loss,
    )
