"""Synthetic PolyTrace workloads sampled from the published task distributions:
``python -m orchestrator.trace generate --task math|tool_calling --steps N --batch B --seed S -o DIR``.

PolyTrace publishes fitted length distributions of a production deployment
(``task_distribution_parameters.json``: 385,024 math samples, 241,546 tool-calling
sessions). The parameters this module needs ship in ``data/polytrace_distributions.json``
(:func:`derive_parameters` of the published file; ``--parameters`` takes either form).
A generated directory is a multi-turn workload (``multiturn_workload_step_N.jsonl``, the
format of ``data/search_r1``) plus a manifest (``generated.json``), so the reader, the
report and replay take it unchanged. Each step has ``B`` trajectories in groups of ``G``
samples that share one prompt (and so one prompt length), as GRPO batches them.

What is sampled:

* **math** — one generation turn. ``joint`` (default): the published 4-component Gaussian
  mixture over (input, output) tokens. A group's prompt length is drawn from the mixture's
  input marginal and each sample's output from the mixture conditioned on it, so every
  sample's (input, output) pair follows the published joint law. ``marginal``: the published
  log-normal fits, independent. The two disagree by an order of magnitude (median output
  ~8k tokens under the mixture, ~770 under the log-normal, whose published KS against the
  data is 0.11) — the mixture is the better fit and the default.
* **tool_calling** — a session of ``k`` generation calls, ``k`` from the published call-count
  histogram (1-10). Call ``i`` reads ``input_i`` new tokens (the prompt for the first call,
  the previous tool's response after it) and writes ``output_i``; every call but the last
  ends in one search tool call. PolyTrace publishes, per ``k``, only the mean vector and
  covariance of its mixture (not the components), and a Gaussian with those moments puts up
  to 31% of some calls' outputs below one token; so per-call lengths are log-normal with the
  published per-count means and variances, tied by a Gaussian copula whose covariance
  reproduces the published one (exactly for 1-8 calls; for 9 and 10 a few pairs lie beyond
  what log-normals reach, and correlations move by up to 0.12). A group's
  prompt is ``input_1``; each sample draws ``k`` given that prompt (Bayes on the per-count
  ``input_1`` laws) and the rest of its lengths conditioned on it. Tool latency and status
  come from the search latency model fitted to PolyTrace (:mod:`sandboxes.search.latency`,
  empirical mode), ``query_count`` from that fit's per-bucket call counts.

How close a generated tool-calling workload comes to the published parameters is measured by
:func:`tool_calling_distances` (tested in ``tests/orchestrator/trace/test_generate.py``;
docs/traces.md gives the figures of 200,000 sessions): the call-count histogram's total variation
distance and KS, and for every per-call length (``input_i``, ``output_i`` of a ``k``-call
session) the KS statistic against the log-normal with the published mean and variance and
the relative errors of its mean and standard deviation. The published file gives only those
moments per count (its mixture components are not published), so that log-normal is the
law the published parameters pin down; the copula's correlations are compared too.

Lengths are rounded and at least one token. The response (generated plus tool tokens) is cut
at ``max_response_tokens``: a turn that reaches it ends with ``finish_reason: length``, as does
its trajectory (a tool response that reaches it is cut and ends the trajectory). Limits: no
engine time is modelled (``engine_latency_s`` is 0: a replay's engine computes its own), no
reward, a turn-0 prefix cache is empty and a later turn's cache holds the whole previous
context. Step ``N`` draws from ``seed`` and ``N`` only, so the first steps of a longer run
equal a shorter one's; the same arguments write byte-identical files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.trace.reader import read_task_distribution, step_file
from orchestrator.trace.records import TaskDistribution, ToolCallTrace, TurnRecord, WorkloadRecord
from sandboxes.search.latency import SHIPPED as SEARCH_LATENCY_FIT
from sandboxes.search.latency import TraceFaultModel

PARAMETERS = Path(__file__).parent / "data" / "polytrace_distributions.json"
MANIFEST = "generated.json"
TASKS = ("math", "tool_calling")
MATH_MODELS = ("joint", "marginal")
DEFAULT_GROUP_SIZE = 8  # the published traces: 8 samples per prompt (search_r1, rllm)
DEFAULT_MAX_RESPONSE_TOKENS = 16384
SOURCE = ("PolyTrace task_distribution_parameters.json (Zhou-jiecheng/PolyTrace @ 4246156, "
          "arXiv 2509.25279; Intern S1 workloads: 385,024 math samples, 241,546 tool-calling "
          "sessions)")


# -- parameters ------------------------------------------------------------------------------


def derive_parameters(dist: TaskDistribution) -> dict[str, Any]:
    """The part of the published file a generator needs, as shipped in :data:`PARAMETERS`."""
    gmm = dist.math_task["gmm_parameters"]
    sequences = {}
    for key, model in sorted(dist.tool_calling_task["sequence_models"].items(), key=lambda kv: int(kv[0])):
        k = int(key)
        names = [f"input_{i}" for i in range(1, k + 1)] + [f"output_{i}" for i in range(1, k + 1)]
        index = [model["feature_names"].index(n) for n in names]
        cov = model["covariance_matrix"]
        sequences[str(k)] = {"features": names,
                             "mean": [model["mean_vector"][i] for i in index],
                             "covariance": [[cov[i][j] for j in index] for i in index]}
    return {
        "source": SOURCE,
        "derived_by": "orchestrator.trace.generate.derive_parameters",
        "math": {
            "gmm": {"weights": gmm["weights"], "means": gmm["means"],
                    "covariances": gmm["covariances"], "features": ["input", "output"]},
            "input_lognorm": list(dist.math_lognorm("input")),
            "output_lognorm": list(dist.math_lognorm("output")),
            "lognorm_ks": {w: dist.math_task[f"{w}_distribution"]["ks_statistic"]
                           for w in ("input", "output")},
        },
        "tool_calling": {
            "call_counts": {str(k): v for k, v in dist.call_count_histogram().items()},
            "sequences": sequences,
        },
    }


@dataclass(frozen=True)
class MathModel:
    weights: np.ndarray  # (c,)
    means: np.ndarray  # (c, 2): input, output tokens
    covs: np.ndarray  # (c, 2, 2)
    input_lognorm: tuple[float, float, float]  # scipy's (shape, loc, scale)
    output_lognorm: tuple[float, float, float]


@dataclass(frozen=True)
class CallModel:
    """Per-call lengths of a ``k``-call session, in log space: ``log input_1`` ~ N(mean[0],
    var0); the rest given it ~ ``mean[1:] + slope * (z - mean[0]) + chol @ N(0, I)``."""

    k: int
    mean: np.ndarray  # (2k,) input_1..k, output_1..k
    cov: np.ndarray  # (2k, 2k)
    slope: np.ndarray  # (2k-1,)
    chol: np.ndarray  # (2k-1, 2k-1)

    @classmethod
    def moment_matched(cls, k: int, mean: np.ndarray, cov: np.ndarray) -> CallModel:
        sigma2 = np.log1p(np.diag(cov) / mean**2)
        mu = np.log(mean) - sigma2 / 2
        # Cov(e^Y_i, e^Y_j) = m_i m_j (e^S_ij - 1); a pair a log-normal cannot reach is clipped.
        s = np.log(np.clip(1 + cov / np.outer(mean, mean), 1e-3, None))
        sd = np.sqrt(sigma2)
        corr = np.clip(s / np.outer(sd, sd), -0.999, 0.999)
        np.fill_diagonal(corr, 1.0)
        w, v = np.linalg.eigh(corr)  # the nearest PSD correlation (eigenvalues floored)
        corr = (v * np.maximum(w, 1e-6)) @ v.T
        d = np.sqrt(np.diag(corr))
        s = corr / np.outer(d, d) * np.outer(sd, sd)
        slope = s[1:, 0] / s[0, 0]
        rest = s[1:, 1:] - np.outer(s[1:, 0], s[1:, 0]) / s[0, 0]
        return cls(k, mu, s, slope, np.linalg.cholesky(rest + 1e-9 * np.eye(len(rest))))


@dataclass(frozen=True)
class Parameters:
    math: MathModel
    call_counts: dict[int, float]  # k -> probability
    calls: dict[int, CallModel]
    source: str

    @classmethod
    def load(cls, path: Path | None = None) -> Parameters:
        """The shipped parameters, or those of ``path``: a published
        ``task_distribution_parameters.json`` or a file in the shipped form."""
        path = Path(path) if path is not None else PARAMETERS
        data = json.loads(path.read_text())
        if "math_task" in data:
            data = derive_parameters(read_task_distribution(path))
        m, t = data["math"], data["tool_calling"]
        counts = {int(k): float(v) for k, v in t["call_counts"].items()}
        total = sum(counts.values())
        calls = {int(k): CallModel.moment_matched(int(k), np.asarray(s["mean"], float),
                                                  np.asarray(s["covariance"], float))
                 for k, s in t["sequences"].items()}
        return cls(
            math=MathModel(np.asarray(m["gmm"]["weights"], float), np.asarray(m["gmm"]["means"], float),
                           np.asarray(m["gmm"]["covariances"], float),
                           tuple(m["input_lognorm"]), tuple(m["output_lognorm"])),  # type: ignore[arg-type]
            call_counts={k: counts[k] / total for k in sorted(counts) if k in calls},
            calls=calls, source=data.get("source", str(path)))


# -- sampling (raw lengths, before rounding and clipping) ------------------------------------


def _normal_pdf(x: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * ((x - mean) / sd) ** 2) / sd


def _pick(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One index per row of ``probs`` (rows sum to 1)."""
    u = rng.random(probs.shape[:-1])
    return np.minimum((u[..., None] > np.cumsum(probs, -1)).sum(-1), probs.shape[-1] - 1)


def sample_math(rng: np.random.Generator, model: MathModel, groups: int, group_size: int,
                how: str = "joint") -> tuple[np.ndarray, np.ndarray]:
    """Prompt length per group ``(groups,)`` and output length per sample ``(groups, size)``."""
    if how == "marginal":
        def lognorm(p: tuple[float, float, float], shape: tuple[int, ...]) -> np.ndarray:
            return p[1] + p[2] * np.exp(p[0] * rng.standard_normal(shape))
        return lognorm(model.input_lognorm, (groups,)), lognorm(model.output_lognorm, (groups, group_size))
    mu0, mu1 = model.means[:, 0], model.means[:, 1]
    s00, s01, s11 = model.covs[:, 0, 0], model.covs[:, 0, 1], model.covs[:, 1, 1]
    lead = _pick(rng, np.broadcast_to(model.weights, (groups, len(model.weights))))
    x = rng.normal(mu0[lead], np.sqrt(s00[lead]))
    post = model.weights * _normal_pdf(x[:, None], mu0, np.sqrt(s00))  # component | input
    post /= post.sum(1, keepdims=True)
    comp = _pick(rng, np.repeat(post[:, None, :], group_size, axis=1))
    mean = mu1[comp] + (s01 / s00)[comp] * (x[:, None] - mu0[comp])
    sd = np.sqrt(s11 - s01**2 / s00)[comp]
    return x, mean + sd * rng.standard_normal((groups, group_size))


def sample_tool_calling(rng: np.random.Generator, params: Parameters, groups: int,
                        group_size: int) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Prompt length per group and, per sample, its ``2k`` per-call lengths
    (``input_1..k, output_1..k``; ``input_1`` is the group's prompt)."""
    ks = np.array(list(params.call_counts))
    p = np.array([params.call_counts[k] for k in ks])
    m0 = np.array([params.calls[k].mean[0] for k in ks])
    sd0 = np.sqrt([params.calls[k].cov[0, 0] for k in ks])
    lead = _pick(rng, np.broadcast_to(p, (groups, len(ks))))
    z = rng.normal(m0[lead], sd0[lead])  # log prompt length
    post = p * _normal_pdf(z[:, None], m0, sd0)  # call count | prompt
    post /= post.sum(1, keepdims=True)
    counts = ks[_pick(rng, np.repeat(post[:, None, :], group_size, axis=1))]
    samples = []
    for g in range(groups):
        row = []
        for k in counts[g]:
            c = params.calls[int(k)]
            rest = c.mean[1:] + c.slope * (z[g] - c.mean[0]) + c.chol @ rng.standard_normal(2 * c.k - 1)
            row.append(np.exp(np.concatenate([[z[g]], rest])))
        samples.append(row)
    return np.exp(z), samples


def tokens(x: float) -> int:
    return max(1, int(np.rint(x)))


# -- records ---------------------------------------------------------------------------------


def _turn(i: int, context: int, cached: int, budget: int, completion: int, reason: str,
          calls: int) -> TurnRecord:
    return TurnRecord(
        turn=i, generation_prompt_len=context, prompt_tokens=context, cached_tokens=cached,
        max_new_tokens=budget, completion_tokens=completion, generated_text_token_len=completion,
        assistant_append_len=completion, assistant_loss_len=completion,
        total_len_after=context + completion, finish_reason=reason, tool_call_count=calls,
        engine_latency_s=0.0)


def _record(step: int, group: int, sample: int, prompt: int, max_response: int,
            turns: list[TurnRecord], calls: list[ToolCallTrace], finish: str) -> WorkloadRecord:
    mask: list[tuple[int, int]] = []
    by_turn = {c.turn: c for c in calls}
    for t in turns:
        mask.append((1, t.completion_tokens))
        if t.turn in by_turn:
            mask.append((0, by_turn[t.turn].append_len))
    response = sum(n for _, n in mask)
    loss = sum(n for bit, n in mask if bit)
    return WorkloadRecord(
        step=step, prompt_len=prompt, max_response_len=max_response,
        max_model_len=prompt + max_response, turns=tuple(turns), tool_calls=tuple(calls),
        finish_reason=finish, final_total_len=prompt + response, final_response_len=response,
        final_response_attention_len=response, final_response_loss_len=loss,
        response_loss_mask_rle=tuple(mask), turn_count=len(turns), tool_call_count=len(calls),
        validate=False, prompt_group_id=group, sample_id=sample)


def math_record(step: int, group: int, sample: int, prompt: int, output: int,
                max_response: int) -> WorkloadRecord:
    completion = min(output, max_response)
    reason = "length" if output >= max_response else "stop"
    return _record(step, group, sample, prompt, max_response,
                   [_turn(0, prompt, 0, max_response, completion, reason, 0)], [], reason)


class _Tools:
    """Search calls: ``query_count`` from the latency fit's bucket counts, then its model."""

    def __init__(self, fit: dict[str, Any], rng: np.random.Generator) -> None:
        buckets = fit["buckets"]
        self.counts = np.array([int(name.rstrip("+")) for name in buckets])  # "3+" -> 3
        weights = np.array([buckets[name]["count"] for name in buckets], float)
        self.p = weights / weights.sum()
        self.rng = rng
        self.model = TraceFaultModel("empirical", fit, seed=int(rng.integers(2**63)))

    def call(self, turn: int, append: int) -> ToolCallTrace:
        qc = int(self.counts[_pick(self.rng, self.p)])
        latency, status = self.model.sample(qc)
        return ToolCallTrace(turn=turn, tool_name="search", query_count=qc, latency_s=latency,
                             response_token_len=append, append_len=append, loss_len=0,
                             status=status, total_results=3 * qc if status == "success" else 0)


def tool_record(step: int, group: int, sample: int, lengths: np.ndarray, max_response: int,
                tools: _Tools) -> WorkloadRecord:
    k = len(lengths) // 2
    inputs, outputs = [tokens(x) for x in lengths[:k]], [tokens(x) for x in lengths[k:]]
    prompt, response = inputs[0], 0
    turns: list[TurnRecord] = []
    calls: list[ToolCallTrace] = []
    finish = "stop"
    for i in range(k):
        context = prompt + response
        cached = turns[-1].total_len_after - 1 if turns else 0  # all but the last token's KV
        budget = max_response - response
        if outputs[i] >= budget:
            turns.append(_turn(i, context, cached, budget, budget, "length", 0))
            finish = "length"
            break
        last = i == k - 1
        turns.append(_turn(i, context, cached, budget, outputs[i], "stop" if last else "tool_calls",
                           0 if last else 1))
        response += outputs[i]
        if last:
            break
        append = min(inputs[i + 1], max_response - response)
        calls.append(tools.call(i, append))
        response += append
        if response >= max_response:  # the tool response filled the budget
            finish = "length"
            break
    return _record(step, group, sample, prompt, max_response, turns, calls, finish)


def step_records(task: str, step: int, batch: int, seed: int, params: Parameters,
                 max_response_tokens: int, group_size: int, math_model: str = "joint",
                 latency_fit: dict[str, Any] | None = None) -> list[WorkloadRecord]:
    """The ``batch`` trajectories of one step; they depend on ``seed`` and ``step`` only."""
    rng = np.random.default_rng([seed, step])
    groups = batch // group_size
    if task == "math":
        prompts, outputs = sample_math(rng, params.math, groups, group_size, math_model)
        return [math_record(step, g, j, tokens(prompts[g]), tokens(outputs[g, j]), max_response_tokens)
                for g in range(groups) for j in range(group_size)]
    _, samples = sample_tool_calling(rng, params, groups, group_size)
    tools = _Tools(latency_fit or json.loads(SEARCH_LATENCY_FIT.read_text()), rng)
    return [tool_record(step, g, j, lengths, max_response_tokens, tools)
            for g, row in enumerate(samples) for j, lengths in enumerate(row)]


# -- how close a workload is to the published parameters -------------------------------------


def ks_rounded(values: Any, cdf: Any) -> float:
    """The KS statistic of integer samples ``max(1, round(x))`` against the law of ``x`` (its
    CDF ``cdf``): the discrete CDF at ``n`` is ``cdf(n + 0.5)`` for ``n >= 1`` (the mass below
    one lands on 1), so rounding costs nothing."""
    a = np.sort(np.asarray(values))
    uniq = np.unique(a)
    above = np.searchsorted(a, uniq, side="right") / len(a)
    below = np.searchsorted(a, uniq, side="left") / len(a)
    hi = np.array([cdf(v + 0.5) for v in uniq])
    lo = np.array([cdf(v - 0.5) if v > 1 else 0.0 for v in uniq])
    return float(max(np.abs(above - hi).max(), np.abs(below - lo).max()))


def _lognormal_cdf(mean: float, var: float) -> Any:
    """The CDF of the log-normal with this mean and variance."""
    s2 = math.log1p(var / mean**2)
    mu, s = math.log(mean) - s2 / 2, math.sqrt(s2)
    return lambda x: 0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - mu) / (s * math.sqrt(2))))


@dataclass(frozen=True)
class Distance:
    """One quantity of a generated workload against the published parameters."""

    quantity: str  # "calls", or "k=3 output_2"
    n: int  # samples it rests on
    ks: float
    mean_err: float = 0.0  # relative error of the mean
    sd_err: float = 0.0  # relative error of the standard deviation
    tv: float = 0.0  # total variation distance (the call-count histogram)


def per_call_lengths(record: WorkloadRecord) -> list[int]:
    """``input_1..k, output_1..k`` of a tool-calling record (unclipped)."""
    inputs = [record.prompt_len, *(c.response_token_len for c in record.tool_calls)]
    return inputs + [t.completion_tokens for t in record.turns]


def tool_calling_distances(records: list[WorkloadRecord], params: Parameters,
                           min_n: int = 200) -> list[Distance]:
    """How far ``records`` (a tool-calling workload, one session a record, generated without
    clipping) lie from ``params``: the call-count histogram (KS over its CDF, and total
    variation), then each per-call length of each call count with at least ``min_n`` sessions
    (KS against the log-normal of the published mean and variance, relative errors of mean and
    standard deviation); last, ``corr k=K``: the largest gap between the sample correlations of
    a count's lengths and the published ones (as ``ks``)."""
    data = json.loads(PARAMETERS.read_text())["tool_calling"]["sequences"]
    counts = np.array([r.turn_count for r in records])
    ks_ = sorted(params.call_counts)
    observed = np.array([(counts == k).mean() for k in ks_])
    published = np.array([params.call_counts[k] for k in ks_])
    out = [Distance("calls", len(records),
                    float(np.abs(np.cumsum(observed) - np.cumsum(published)).max()),
                    tv=float(np.abs(observed - published).sum() / 2))]
    for k in ks_:
        rows = np.array([per_call_lengths(r) for r in records if r.turn_count == k], float)
        if len(rows) < min_n:
            continue
        seq = data[str(k)]
        mean, cov = np.asarray(seq["mean"]), np.asarray(seq["covariance"])
        for i, name in enumerate(seq["features"]):
            x, sd = rows[:, i], math.sqrt(cov[i, i])
            out.append(Distance(f"k={k} {name}", len(rows), ks_rounded(x, _lognormal_cdf(mean[i], cov[i, i])),
                                float(x.mean() / mean[i] - 1), float(x.std() / sd - 1)))
        sd = np.sqrt(np.diag(cov))
        gap = np.abs(np.corrcoef(rows.T) - cov / np.outer(sd, sd)).max()
        out.append(Distance(f"corr k={k}", len(rows), float(gap)))
    return out


# -- the workload directory ------------------------------------------------------------------


def _check(task: str, steps: int, batch: int, max_response_tokens: int, group_size: int,
           math_model: str) -> None:
    if task not in TASKS:
        raise ValueError(f"--task {task!r} must be one of {', '.join(TASKS)}")
    if math_model not in MATH_MODELS:
        raise ValueError(f"--math-model {math_model!r} must be one of {', '.join(MATH_MODELS)}")
    if steps < 1 or group_size < 1 or max_response_tokens < 1:
        raise ValueError("--steps, --group-size and --max-response-tokens must be at least 1")
    if batch < group_size or batch % group_size:
        raise ValueError(f"--batch {batch} must be a positive multiple of --group-size {group_size} "
                         f"(B trajectories per step in prompt groups of G)")


def generate_workload(task: str, steps: int, batch: int, seed: int, out: Path,
                      max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS,
                      group_size: int = DEFAULT_GROUP_SIZE, math_model: str = "joint",
                      parameters: Path | None = None) -> Path:
    """Write a ``steps``-step workload of ``batch`` trajectories per step to ``out`` (a
    PolyTrace directory: ``multiturn_workload_step_{0..steps-1}.jsonl`` and ``generated.json``);
    returns ``out``. A directory this function wrote before is overwritten; one that holds
    another trace is refused."""
    _check(task, steps, batch, max_response_tokens, group_size, math_model)
    out = Path(out)
    existing = sorted(out.glob("multiturn_workload_step_*.jsonl")) if out.is_dir() else []
    if existing and not (out / MANIFEST).is_file():
        raise ValueError(f"{out} already holds a workload that was not generated here; "
                         f"choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    for path in existing:  # an earlier generation's steps: replaced, never mixed
        path.unlink()
    params = Parameters.load(parameters)
    fit = json.loads(SEARCH_LATENCY_FIT.read_text()) if task == "tool_calling" else None
    for step in range(steps):
        records = step_records(task, step, batch, seed, params, max_response_tokens, group_size,
                               math_model, fit)
        with (out / step_file("multiturn_workload", step)).open("w") as f:
            for record in records:
                f.write(json.dumps(record.to_dict()) + "\n")
    manifest = {
        "generator": "python -m orchestrator.trace generate", "task": task, "steps": steps,
        "batch": batch, "group_size": group_size, "seed": seed,
        "max_response_tokens": max_response_tokens,
        "lengths": (f"math {math_model}" if task == "math" else
                    "call counts + per-call log-normal copula"),
        "tool_latency": "sandboxes.search.latency (search_r1 fit, empirical)" if fit else None,
        "engine_latency_s": "not modelled (0.0)", "parameters": params.source,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out

