"""Evaluation as the field reports it (orchestrator/pipeline/evaluation.py): pass@k against
exhaustive enumeration, maj@n, per-source figures, ``eval.n`` samples per task, bad ``eval.k`` in
one line, and the typed record through a checkpoint, a resume and ``summary.json``."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from helpers import TOK, quick_config, scripted_engine
from omegaconf import OmegaConf

from envs.arithmetic import ArithmeticSpec
from envs.base import EnvSpec, Task
from envs.code import CodeSpec
from orchestrator.builders import run
from orchestrator.config.read import typed
from orchestrator.config.schema import EvalConfig, RolloutConfig
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.pipeline.evaluation import evaluate, majority, pass_at_k, score
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.run.resume import RunState
from orchestrator.trace.recorder import Recorder
from orchestrator.types import EvalSample, Evaluation


def sample(task: int, index: int, reward: float, answer: str | None = None,
           source: str = "a", tokens: int = 3) -> EvalSample:
    return EvalSample(task_id=task, sample_index=index, source=source, reward=reward,
                      tokens=tokens, answer=answer, prompt=f"q{task}", completion=f"c{index}")


def by_text(samples: list[EvalSample]) -> list[EvalSample]:
    """``samples`` grouped for maj@n as equal answer text (what evaluate's votes set): each
    sample's vote the index of its task's first sample with its answer."""
    first: dict[tuple[int, str], int] = {}
    for s in sorted(samples, key=lambda s: s.sample_index):
        if s.answer is not None:
            first.setdefault((s.task_id, s.answer), s.sample_index)
    return [replace(s, vote=None if s.answer is None else first[(s.task_id, s.answer)])
            for s in samples]


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n: int) -> None:
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            exact = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_is_not_a_with_replacement_bootstrap() -> None:
    # verl#7240: one correct answer in four; every draw of all four holds it
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3, 2) / C(5, 2)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_majority_votes_over_answer_groups() -> None:
    # "7" twice, "5" once: the vote is 7, scored by the samples that gave it
    assert majority(by_text([sample(0, 0, 0.0, "5"), sample(0, 1, 1.0, "7"),
                             sample(0, 2, 1.0, "7")])) == 1.0
    # a tie goes to the answer given first (by sample index, whatever the order handed in)
    assert majority(by_text([sample(0, 1, 1.0, "7"), sample(0, 0, 0.0, "5")])) == 0.0
    # samples without an answer do not vote; none at all: 0
    assert majority(by_text([sample(0, 0, 1.0, None), sample(0, 1, 0.0, "3"),
                             sample(0, 2, 1.0, None)])) == 0.0
    assert majority([sample(0, 0, 1.0, None)]) == 0.0
    # partial credit: the mean reward of the samples that gave the voted answer
    assert majority(by_text([sample(0, 0, 0.5, "x"), sample(0, 1, 1.0, "x")])) == 0.75


def test_figures_per_source_and_over_all_tasks() -> None:
    config = EvalConfig(n=4, temperature=1.0, k=[1, 2, 4])
    rewards = {("a", 0): [1, 0, 0, 0], ("a", 1): [1, 1, 1, 1], ("b", 2): [0, 0, 0, 0]}
    samples = [sample(task, i, float(r), answer=str(r), source=source, tokens=i + 1)
               for (source, task), rs in rewards.items() for i, r in enumerate(rs)]
    samples = by_text(samples)
    random.Random(0).shuffle(samples)  # they finish in any order
    evaluation = score(samples, config, examples=1)
    a, b, overall = evaluation.sources["a"], evaluation.sources["b"], evaluation.overall
    assert (a.tasks, a.samples, b.tasks, overall.tasks, overall.samples) == (2, 8, 1, 3, 12)
    assert a.mean == pytest.approx(5 / 8) and b.mean == 0.0 and overall.mean == pytest.approx(5 / 12)
    assert a.std == pytest.approx((0.4330127 + 0.0) / 2)  # a task's own spread, averaged
    assert a.pass_at == pytest.approx({1: (0.25 + 1) / 2, 2: (0.5 + 1) / 2, 4: 1.0})
    assert overall.pass_at[4] == pytest.approx(2 / 3)
    assert a.maj == 0.5 and b.maj == 0.0  # task 0 votes "0" (three of four)
    assert overall.response_tokens == pytest.approx(2.5)
    assert evaluation.mean == overall.mean
    metrics = evaluation.metrics("eval")
    assert metrics["eval/a/pass@2"] == pytest.approx(0.75) and metrics["eval/b/mean@4"] == 0.0
    assert {"eval/mean@4", "eval/std@4", "eval/pass@1", "eval/maj@4",
            "eval/response_tokens"} <= set(metrics)
    assert [(s.source, s.task_id, s.sample_index) for s in evaluation.examples] == [
        ("a", 0, 0), ("b", 2, 0)]
    assert "mean@4 0.417" in evaluation.describe()
    assert Evaluation.from_dict(json.loads(json.dumps(evaluation.to_dict()))) == \
        Evaluation(**{**evaluation.__dict__, "examples": (), "samples": ()})


def test_no_maj_where_no_sample_gives_an_answer() -> None:
    evaluation = score([sample(0, 0, 1.0, None, source="code")], EvalConfig())
    assert evaluation.overall.maj is None and "eval/maj@1" not in evaluation.metrics()
    assert Evaluation.from_dict(evaluation.to_dict()).overall.maj is None


def test_eval_k_larger_than_n_is_one_line_naming_it() -> None:
    cfg = OmegaConf.create({"eval": {"n": 4, "k": [1, 8]}})
    with pytest.raises(ConfigError) as error:
        typed(EvalConfig, cfg, "eval")
    message = str(error.value)
    assert "\n" not in message and "eval.k=[1, 8]" in message and "eval.n=4" in message
    with pytest.raises(ConfigError, match="eval.k=0"):
        EvalConfig(k=0)
    with pytest.raises(ConfigError, match="eval.n must be >= 1"):
        EvalConfig(n=0)
    assert EvalConfig().ks == (1,) and EvalConfig(n=8).ks == (1, 8)
    assert typed(EvalConfig, OmegaConf.create({"eval": {"n": 8, "k": 4}}), "eval").ks == (4,)


@pytest.mark.anyio
async def test_n_samples_per_task_at_the_eval_temperature() -> None:
    spec = ArithmeticSpec(digits=2, train_size=8, eval_size=3, seed=0)
    tasks = list(spec.tasks("eval")) + [Task(id=9, messages=spec.tasks("eval")[0].messages,
                                             answer="x", metadata={"data_source": "other"})]
    calls = iter(range(1 << 20))
    answers = {tuple(TOK.chat_prompt(t.messages)): t.answer for t in tasks[:3]}
    # every other call right: each task gets some right, some wrong
    engine = scripted_engine(lambda p: answers.get(tuple(p), "1") if next(calls) % 2 else "1")
    runner = EpisodeRunner(engine, TOK, spec, RolloutConfig(temperature=1.0), Recorder())
    with anyio.fail_after(10):
        evaluation = await evaluate(runner, tasks, EvalConfig(n=4, temperature=0.6, k=[1, 4]))
    assert len(engine.replies.sampling) == 16
    assert {s.temperature for s in engine.replies.sampling} == {0.6}
    assert set(evaluation.sources) == {"arithmetic", "other"}
    assert evaluation.sources["arithmetic"].samples == 12 and evaluation.overall.samples == 16
    assert evaluation.sources["other"].mean == 0.0
    assert 0 < evaluation.sources["arithmetic"].mean < 1
    assert evaluation.sources["arithmetic"].pass_at[4] >= evaluation.sources["arithmetic"].pass_at[1]
    example = evaluation.examples[0]
    assert example.prompt and example.answer in (example.reference, "1") and example.tokens >= 1


def test_run_state_keeps_the_evaluation(tmp_path: Path) -> None:
    evaluation = score([sample(0, 0, 1.0, "1"), sample(0, 1, 0.0, "2")], EvalConfig(n=2))
    state = RunState(pipeline={"step": 1, "dropped": 0, "sampler": {}}, version=1,
                     eval_before=evaluation)
    state.write(tmp_path, {})
    assert RunState.read(tmp_path).eval_before == Evaluation(**{**evaluation.__dict__,
                                                               "examples": (), "samples": ()})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_record_through_a_run_its_resume_and_summary_json(tmp_path: Path) -> None:
    cfg = quick_config("smoke", "eval.n=2", "eval.temperature=1.0", "eval.k=[1,2]",
                       "eval.every=1", "checkpoint.every=1")
    first = run(cfg, tmp_path)
    assert first.eval_before is not None and first.eval_before.n == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    before = summary["eval_before_detail"]
    assert summary["eval_before"] == before["overall"]["mean@2"]  # the headline, as before
    assert before["n"] == 2 and set(before["sources"]) == {"arithmetic"}
    assert before["overall"]["samples"] == 8 and "pass@2" in before["overall"]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records[-1]["summary/eval_after/arithmetic/pass@2"] == \
        summary["eval_after_detail"]["sources"]["arithmetic"]["pass@2"]
    evaluated = [m for m in records[:-1] if "eval/accuracy" in m]
    for m in evaluated:  # periodic evaluations: every figure in the step's line, its se too
        assert m["eval/accuracy"] == m["eval/mean@2"] and "eval/arithmetic/pass@2" in m
        assert m["eval/pass@2_se"] >= 0 and "eval/arithmetic/mean@2_se" in m
    assert "summary/eval_after/pass@2_se" in records[-1]
    written = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert {w["when"] for w in written} >= {"before", "after"}
    assert all({"prompt", "completion", "reply", "reward", "answer", "vote"} <= set(w)
               for w in written)
    # every sample of every evaluation is written (4 tasks x 2), none kept in the reports
    per_evaluation = Counter((w["when"], w["step"]) for w in written)
    assert set(per_evaluation.values()) == {8}
    assert all(r.evaluation is None or r.evaluation.samples == () for r in first.reports)

    # resumed from the first step's checkpoint: the evaluation before RL comes back whole
    checkpoint = CheckpointStore(tmp_path / "checkpoints").path(1)
    resumed = run(cfg, tmp_path, resume_from=checkpoint)
    assert resumed.eval_before == Evaluation.from_dict(before)
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["eval_before_detail"] == before and again["eval_before"] == summary["eval_before"]
    assert again["eval_after_detail"]["n"] == 2
    written = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert [w["when"] for w in written].count("before") == len(first.eval_before.samples)


def test_which_environments_extract_an_answer_to_vote_on() -> None:
    spec = ArithmeticSpec(digits=2, train_size=8, eval_size=3, seed=0)
    assert spec.extract_answer(" 42\n") == "42" and spec.extract_answer("  ") is None
    default = EnvSpec.extract_answer  # boxed, then <answer> tags, then the last number
    assert default(spec, r"so \boxed{7}, not 8") == "7"
    assert default(spec, "<answer>Paris</answer>") == "Paris"
    assert default(spec, "it is 12 or 13") == "13" and default(spec, "no idea") is None
    assert CodeSpec.extract_answer(spec, "def f(x): return 1") is None  # type: ignore[arg-type]


def test_every_figure_has_its_standard_error_over_tasks() -> None:
    # four tasks of two samples: task means 1, 0.5, 0, 0.5
    rewards = [[1, 1], [1, 0], [0, 0], [0, 1]]
    samples = by_text([sample(t, i, float(r), answer=str(r), tokens=t + 1)
                       for t, rs in enumerate(rewards) for i, r in enumerate(rs)])
    evaluation = score(samples, EvalConfig(n=2, temperature=1.0, k=[1, 2]))
    overall = evaluation.overall
    means = [1.0, 0.5, 0.0, 0.5]  # the analytic se, written out: sd of task means / sqrt(T)
    centre = sum(means) / 4
    assert overall.se["mean"] == pytest.approx(
        (sum((m - centre) ** 2 for m in means) / 3) ** 0.5 / 2)
    assert overall.se["response_tokens"] == pytest.approx(
        (sum((x - 2.5) ** 2 for x in [1, 2, 3, 4]) / 3) ** 0.5 / 2)
    # pass@k and maj@n by the bootstrap over tasks: seeded, near the analytic se of the
    # per-task values, 0 for one task
    assert set(overall.errors(2)) == set(overall.metrics(2))
    again = score(samples, EvalConfig(n=2, temperature=1.0, k=[1, 2]))
    assert again.overall.se == overall.se
    reseeded = score(samples, EvalConfig(n=2, temperature=1.0, k=[1, 2], seed=5))
    assert reseeded.overall.se["pass@2"] != overall.se["pass@2"]
    assert overall.se["pass@1"] == pytest.approx(overall.se["mean"], rel=0.15)
    one = score(samples[:2], EvalConfig(n=2, temperature=1.0))
    assert one.overall.se["pass@2"] == 0.0 and one.overall.se["mean"] == 0.0
    # in the record (and back), the loggers' metrics, the one-line summary
    assert Evaluation.from_dict(json.loads(json.dumps(evaluation.to_dict()))).overall.se == \
        overall.se
    metrics = evaluation.metrics("eval")
    assert metrics["eval/pass@2_se"] == overall.se["pass@2"]
    assert metrics["eval/a/maj@2_se"] == evaluation.sources["a"].se["maj"]
    assert f"mean@2 0.500 ± {overall.se['mean']:.3f}" in evaluation.describe()


def test_the_bootstrap_agrees_with_the_analytic_error_on_many_tasks() -> None:
    rng = random.Random(1)
    samples = [sample(t, i, float(rng.random() < 0.3 + 0.4 * (t % 2)), answer="x")
               for t in range(300) for i in range(4)]
    overall = score(by_text(samples), EvalConfig(n=4, temperature=1.0, k=[1])).overall
    # pass@1 of a task is its mean reward: the two errors estimate the same thing
    assert overall.se["pass@1"] == pytest.approx(overall.se["mean"], rel=0.1)


@pytest.mark.anyio
async def test_an_evaluation_samples_with_its_own_max_tokens_top_p_and_top_k() -> None:
    spec = ArithmeticSpec(digits=2, train_size=8, eval_size=2, seed=0)
    engine = scripted_engine(lambda p: "1")
    runner = EpisodeRunner(engine, TOK, spec, RolloutConfig(temperature=1.0, max_tokens=16,
                                                            top_p=0.5, top_k=3), Recorder())
    with anyio.fail_after(10):
        await evaluate(runner, list(spec.tasks("eval")),
                       EvalConfig(n=2, temperature=0.7, max_tokens=5, top_p=0.9, top_k=20))
        used = set(engine.replies.sampling)
        await evaluate(runner, list(spec.tasks("eval")), EvalConfig())  # the rollout's length
    assert {(s.max_tokens, s.temperature, s.top_p, s.top_k) for s in used} == {(5, 0.7, 0.9, 20)}
    assert engine.replies.sampling[-1].max_tokens == 16
    assert (engine.replies.sampling[-1].top_p, engine.replies.sampling[-1].top_k) == (1.0, 0)
    # a training episode samples with the rollout's own top_p / top_k
    with anyio.fail_after(10):
        await runner.episode(spec.tasks("train")[0], "w")
    last = engine.replies.sampling[-1]
    assert (last.max_tokens, last.temperature, last.top_p, last.top_k) == (16, 1.0, 0.5, 3)


@pytest.mark.anyio
@pytest.mark.parametrize(("reward", "reference", "replies", "maj"), [
    # the case: math's reading voted None, None, "1" and maj@3 was 0
    ("choice", "B", ["(B)", "(C), since 2 > 1", "(B)"], 1.0),
    # text answers: math's reading found nothing to vote on
    ("exact", "Paris", ["paris.", "London", "Paris"], 1.0),
    # one half, written two ways, against a wrong third: raw strings tied and took the first
    ("math", "1/2", ["\\boxed{1/3}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}"], 1.0),
])
async def test_a_dataset_evaluation_votes_by_its_reward(
        tmp_path: Path, reward: str, reference: str, replies: list[str], maj: float) -> None:
    """Through evaluate with ``env=dataset``: maj@3 is the majority's reward, mean@3 two in
    three, whichever sample gets which reply."""
    from envs.dataset import DatasetSpec

    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"question": "q?", "answer": reference}) + "\n")
    spec = DatasetSpec(eval=str(test), reward=reward)
    calls = iter(range(1 << 20))
    engine = scripted_engine(lambda p: replies[next(calls) % 3])
    runner = EpisodeRunner(engine, TOK, spec, RolloutConfig(max_tokens=32), Recorder())
    with anyio.fail_after(60):
        async with spec.running():
            evaluation = await evaluate(runner, list(spec.tasks("eval")),
                                        EvalConfig(n=3, temperature=1.0))
    assert evaluation.overall.mean == pytest.approx(2 / 3)
    assert evaluation.overall.maj == maj
