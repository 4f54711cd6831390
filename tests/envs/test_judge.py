"""``env.reward=judge``: the score parser, the rubric, and the judge against a real aiohttp
server (bench.judge_server) that is slow, fails, hangs and talks nonsense: every sample is
scored or counted as failed, within the limits, and the run never stalls."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import anyio
import pytest

from bench.judge_server import Faults, JudgeServer
from envs.errors import EnvConfigError
from envs.judge import DEFAULT_TEMPLATE, Judge, JudgeConfig, load_template, parse_score
from envs.reward_functions import Sample
from envs.rewards import Scorer

PROMPT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"})


@pytest.mark.parametrize(("text", "expected"), [
    ("<score>7</score>", 0.7),
    ("The reply is right.\n<score> 10 </score>", 1.0),
    ("<score>3</score> no wait <score>8</score>", 0.8),  # the last tag
    ("Reasoning...\nScore: 4", 0.4),
    ("Reasoning...\n**Final score: 6/10**", 0.6),
    ("so\n3/4", 0.75),  # the line's own scale
    ("so\n0", 0.0),
    ("so\n2.5.", 0.25),
    ("<score>11</score>", None),  # outside the scale
    ("<score>-1</score>", None),
    ("<score>high</score>", None),
    ("I think it is correct.", None),
    ("Score: 7 out of 10 probably", None),
    ("", None),
])
def test_the_score_is_the_last_tag_or_the_final_line_over_the_scale(text: str,
                                                                    expected: float | None) -> None:
    value = parse_score(text, scale=10)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_a_scale_of_one_reads_probabilities() -> None:
    assert parse_score("<score>0.9</score>", scale=1) == pytest.approx(0.9)
    assert parse_score("<score>9</score>", scale=1) is None


@pytest.mark.parametrize(("config", "message"), [
    ({}, "env.reward=judge needs env.judge.url"),
    ({"url": "localhost:8000"}, "env.judge.url must start with http://"),
    ({"url": "http://x/v1", "timeout_s": 0}, "env.judge.timeout_s must be > 0"),
    ({"url": "http://x/v1", "concurrency": 0}, "env.judge.concurrency must be >= 1"),
    ({"url": "http://x/v1", "retry": 3}, "env.judge has an unknown key 'retry'"),
    ({"url": "http://x/v1", "timeout_s": "soon"}, "env.judge.timeout_s must be a number, got 'soon'"),
    ({"url": "http://x/v1", "retries": 1.5}, "env.judge.retries must be an integer"),
    ({"url": "http://x/v1", "api_key_env": "POLYRL_NO_SUCH_KEY"}, "POLYRL_NO_SUCH_KEY, which is not set"),
    ({"url": "http://x/v1", "template": "Grade {reply} vs {truth}"}, "unknown field {truth}"),
    ({"url": "http://x/v1", "template": "Grade {question} against {answer}"}, "must contain {reply}"),
    ({"url": "http://x/v1", "template": "Grade {reply} {"}, "not a valid template"),
])
def test_bad_judge_settings_are_one_line_when_the_scorer_is_built(config: dict, message: str) -> None:
    with pytest.raises(EnvConfigError, match=message.replace("{", r"\{").replace("}", r"\}")) as info:
        Scorer("judge", judge=config)
    assert "\n" not in str(info.value)


def test_the_template_is_text_or_a_file_and_fills_three_fields(tmp_path: Path) -> None:
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Q: {question}\nA: {reply}\nRef: {answer}\nScore 0-10 as <score>N</score>. {{ok}}")
    assert load_template(str(rubric)).startswith("Q: {question}")
    judge = Judge({"url": "http://x/v1", "template": str(rubric)})
    assert judge.prompt(PROMPT, "5", "5") == "Q: What is 2+3?\nA: 5\nRef: 5\nScore 0-10 as <score>N</score>. {ok}"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "2+3?"}]
    assert "user: hi\nassistant: yo\nuser: 2+3?" in judge.prompt(turns, "5", "5")
    assert load_template(None) == DEFAULT_TEMPLATE


@pytest.mark.anyio
async def test_the_judge_scores_through_the_scorer_with_the_prompt() -> None:
    cases = [("The sum is \\boxed{5}.", "5", 1.0), ("<answer>6</answer>", "5", 0.0),
             ("paris", "Paris", 1.0), ("I don't know", "5", 0.0)]
    async with JudgeServer() as server:
        scorer = Scorer({"judge": 1.0, "format": 0.5}, judge={"url": server.url})
        async with scorer:
            rewards = [await scorer.score(Sample(reply, answer, {}, PROMPT))
                       for reply, answer, _ in cases]
        asked = server.counters["calls"]
    for reward, (reply, _, expected) in zip(rewards, cases, strict=True):
        assert reward.components["judge"] == expected, reply
        assert [t.name for t in reward.terms] == ["judge", "format"]
    assert rewards[0].total == pytest.approx(1.5)
    metrics = scorer.metrics()
    assert asked == 4 and metrics["judge/calls"] == 4 and metrics["judge/scored"] == 4
    assert metrics["judge/unscored"] == 0 and metrics["reward/errors"] == 0


@pytest.mark.anyio
async def test_a_slow_flaky_judge_scores_or_counts_every_sample_and_never_stalls() -> None:
    faults = Faults(delay_s=0.02, hang_every=7, fail_every=5, garbage_every=11, broken_every=13)
    config = JudgeConfig(url="http://placeholder/v1", timeout_s=0.5, retries=2, backoff_s=0.01,
                         concurrency=8)
    samples = [(f"\\boxed{{{i % 3}}}", str(i % 2)) for i in range(60)]
    verdicts: list = [None] * len(samples)
    async with JudgeServer(faults) as server:
        async with Judge(JudgeConfig(**{**config.__dict__, "url": server.url})) as judge:
            started = time.monotonic()
            with anyio.fail_after(20):  # the bound: 60 samples, at worst 3 tries of 0.5 s each
                async with anyio.create_task_group() as tg:
                    for i, (reply, answer) in enumerate(samples):
                        async def one(i: int = i, reply: str = reply, answer: str = answer) -> None:
                            verdicts[i] = await judge.score(PROMPT, reply, answer)
                        tg.start_soon(one)
            elapsed = time.monotonic() - started
        seen = dict(server.counters)
    m = judge.metrics()
    scored = [v for v in verdicts if v.score is not None]
    unscored = [v for v in verdicts if v.score is None]
    assert len(scored) + len(unscored) == 60
    assert m["judge/scored"] == len(scored) and m["judge/unscored"] == len(unscored)
    # every fault the server dealt is a counted failure of its kind
    assert seen["hung"] >= 1 and m["judge/failures/timeout"] == seen["hung"]
    assert seen["failed"] >= 1 and m["judge/failures/server_error"] == seen["failed"]
    assert seen["garbage"] >= 1 and m["judge/failures/unparsable"] == seen["garbage"]
    assert seen["broken"] >= 1 and m["judge/failures/bad_response"] == seen["broken"]
    assert m["judge/calls"] == seen["calls"] and seen["graded"] == len(scored)
    # hangs and 500s are retried, up to twice; a garbage or broken answer is not (the same
    # request would get it again)
    for v in unscored:  # a retried kind gave up after 3 tries; the others at the first
        assert (v.attempts == 3) if v.failure in ("timeout", "server_error") else \
            (v.failure in ("unparsable", "bad_response") and v.attempts <= 3), v
    assert any(v.attempts > 1 and v.score is not None for v in verdicts)  # a retry that scored
    assert all(v.score == (1.0 if r.strip("\\boxed{}") == a else 0.0)
               for v, (r, a) in zip(verdicts, samples, strict=True) if v.score is not None)
    assert elapsed < 10


@pytest.mark.anyio
async def test_a_judge_that_always_hangs_gives_up_after_its_retries() -> None:
    async with JudgeServer(Faults(hang_every=1)) as server:
        judge = Judge({"url": server.url, "timeout_s": 0.2, "retries": 1, "backoff_s": 0.01})
        async with judge:
            started = time.monotonic()
            with anyio.fail_after(5):
                verdict = await judge.score(PROMPT, "5", "5")
            elapsed = time.monotonic() - started
    assert verdict.score is None and verdict.failure == "timeout" and verdict.attempts == 2
    assert judge.metrics()["judge/failures/timeout"] == 2 and judge.metrics()["judge/unscored"] == 1
    assert 0.4 <= elapsed < 2


@pytest.mark.anyio
async def test_judging_overlaps_other_episodes() -> None:
    """Eight episodes awaiting a 0.3 s judge at once: the server holds all eight calls at the
    same time (each episode waits in its own task, none waits for another)."""
    async with JudgeServer(Faults(delay_s=0.3)) as server:
        judge = Judge({"url": server.url, "concurrency": 8})
        async with judge, anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(judge.score, PROMPT, "5", "5")
        assert server.counters["max_inflight"] == 8
    async with JudgeServer(Faults(delay_s=0.05)) as server:
        judge = Judge({"url": server.url, "concurrency": 2})
        async with judge, anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(judge.score, PROMPT, "5", "5")
        assert server.counters["max_inflight"] == 2  # env.judge.concurrency holds


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.anyio
async def test_a_judge_that_does_not_answer_at_start_is_one_line() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    scorer = Scorer("judge", judge={"url": url})
    with pytest.raises(EnvConfigError, match=r"env.judge.url=.*does not answer") as info:
        async with scorer:
            pass
    assert "\n" not in str(info.value)
    # a server that accepts the connection and never answers: the start limit, one line
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with pytest.raises(EnvConfigError, match=r"did not answer GET /models within 0.3 s"):
            async with Judge({"url": url, "start_timeout_s": 0.3}):
                pass


def test_a_run_with_a_judge_that_hangs_finishes_and_counts_them(tmp_path: Path) -> None:
    """The real config and pipeline: env=dataset scored by the judge server, which hangs one
    call in five; the run ends its steps and the hung calls are counted. Then the same run
    with a judge URL nobody answers stops before any step, in one line."""
    pytest.importorskip("datasets", reason="the data extra")
    from hydra import compose, initialize_config_dir

    from bench.judge_server import in_thread
    from orchestrator.builders import run
    from orchestrator.config.read import explain
    from tests.envs.test_dataset import write_jsonl

    repo = Path(__file__).resolve().parents[2]
    train = write_jsonl(tmp_path / "sums.jsonl", [{"question": f"{a}+{a}=", "answer": str(2 * a)}
                                                  for a in range(20)])

    def config(url: str, name: str) -> object:
        with initialize_config_dir(config_dir=str(repo / "conf"), version_base="1.3"):
            return compose("config", overrides=[
                "experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
                "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                "pipeline.num_steps=3", "pipeline.batch_size=8", "pipeline.num_workers=2",
                "warmstart.steps=0", "eval.num_tasks=0", "env=dataset", f"env.train={train}",
                "rollout.max_tokens=4", "env.reward=judge", f"env.judge.url={url}",
                "env.judge.timeout_s=0.3", "env.judge.backoff_s=0.01"])

    with in_thread(Faults(hang_every=5)) as server:
        result = run(config(server.url, "hang"), tmp_path / "run")
        hung = server.counters["hung"]
    assert len(result.reports) == 3
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "judge/scored" in m][-1]
    assert hung >= 1 and 1 <= last["judge/failures/timeout"] <= hung
    assert last["judge/scored"] >= 24 and last["judge/unscored"] == 0

    with pytest.raises(Exception) as info:  # what explain() makes of it is the test
        run(config(f"http://127.0.0.1:{_closed_port()}/v1", "down"), tmp_path / "down")
    line = explain(info.value)
    assert line is not None and "env.judge.url=" in line and "does not answer" in line
    assert "\n" not in line
    assert not (tmp_path / "down" / "metrics.jsonl").exists() or \
        not (tmp_path / "down" / "metrics.jsonl").read_text().strip()


@pytest.mark.anyio
async def test_a_url_without_its_v1_warns_at_start_and_its_calls_count_as_client_errors(
        caplog: pytest.LogCaptureFixture) -> None:
    async with JudgeServer() as server:
        judge = Judge({"url": server.url.removesuffix("/v1"), "retries": 3})
        with caplog.at_level("WARNING", logger="envs.judge"):
            async with judge:
                verdict = await judge.score(PROMPT, "5", "5")
    assert any("answered 404 to GET /models" in r.getMessage() for r in caplog.records)
    assert verdict.score is None and verdict.failure == "client_error" and verdict.attempts == 1
    assert judge.metrics()["judge/failures/client_error"] == 1  # a 404 is not tried again


@pytest.mark.anyio
async def test_the_judge_beside_an_isolated_reward() -> None:
    """The judge awaited in the caller and ``regex`` in a worker process, one item: both
    terms in the weighted sum, both started and stopped with the scorer."""
    async with JudgeServer() as server:
        scorer = Scorer({"judge": 0.5, "regex": 1.0}, judge={"url": server.url})
        async with scorer:
            right = await scorer.score(Sample("\\boxed{42}", "42", {}, PROMPT))
            wrong = await scorer.score(Sample("\\boxed{41}", "4[2]", {}, PROMPT))
    assert right.components == {"judge": 1.0, "regex": 1.0} and right.total == pytest.approx(1.5)
    assert wrong.components == {"judge": 0.0, "regex": 0.0} and wrong.total == 0.0
    assert scorer.metrics()["judge/scored"] == 2
