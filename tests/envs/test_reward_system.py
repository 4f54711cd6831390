"""One reward system (envs/rewards.py): the three conventions adapted by signature, routes by
data source, every way a reward gives up counted by name, async rewards that overlap, and
env.reward honoured by every environment with a user's module:function."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from envs.errors import EnvConfigError
from envs.reward_functions import Sample
from envs.rewards import Scorer

pytestmark = pytest.mark.anyio
PROMPT = ({"role": "user", "content": "1+1="},)


async def test_trl_and_verl_functions_plug_in_as_they_are() -> None:
    """Refused before (``must take (completion, answer, metadata)``)."""
    sample = Sample(" 2 ", "2", {"level": 3, "extra_info": {"split": "train"}}, PROMPT, "gsm8k")
    async with Scorer({"dataset_reward_fns:trl_style": 1.0,
                       "dataset_reward_fns:compute_score": 2.0}) as scorer:
        reward = await scorer.score(sample)
    assert reward.total == pytest.approx(1.3 + 2.0)
    assert reward.components["dataset_reward_fns:compute_score/split_is_train"] == 1.0
    assert reward.components["dataset_reward_fns:compute_score/source_ok"] == 1.0
    # a conversational prompt: TRL's completions are messages too
    system = ({"role": "system", "content": "be brief"}, *PROMPT)
    async with Scorer("dataset_reward_fns:trl_style") as scorer:
        conversational = await scorer.score(Sample("2", "2", {"level": 0}, system))
    assert conversational.total == 1.0 and "failed" not in conversational.components


async def test_a_reward_sees_the_prompt_the_columns_the_source_and_the_transcript() -> None:
    transcript = (*PROMPT, {"role": "assistant", "content": "2"})
    async with Scorer("dataset_reward_fns:sees_everything") as scorer:
        reward = await scorer.score(Sample("2", "2", {"level": 1}, PROMPT, "gsm8k", transcript))
    name = "dataset_reward_fns:sees_everything"
    assert reward.total == 1.0
    assert {k.split("/")[-1]: v for k, v in reward.components.items() if "/" in k} == {
        "prompt_messages": 1.0, "transcript_messages": 2.0, "source_is_gsm8k": 1.0,
        "has_level": 1.0}
    assert [t.name for t in reward.terms] == [name]  # diagnostics are never terms


def test_a_signature_that_fits_no_convention_is_one_line_at_start() -> None:
    with pytest.raises(EnvConfigError) as info:
        Scorer({"math": 1.0, "dataset_reward_fns:fits_nothing": 1.0})
    message = str(info.value)
    assert "\n" not in message and "dataset_reward_fns:fits_nothing(reply" in message
    for convention in ("(completion, answer, metadata", "TRL's (prompts, completions",
                       "verl's compute_score(data_source, solution_str"):
        assert convention in message


async def test_env_reward_routes_by_data_source() -> None:
    reward = {"by_source": {"gsm8k": "strict", "mmlu": {"choice": 1.0, "format": 0.5}},
              "default": "exact"}
    async with Scorer(reward) as scorer:
        assert (await scorer.score(Sample("The answer is 2.", "2", {}, PROMPT, "gsm8k"))).total == 0.0
        mmlu = await scorer.score(Sample(r"\boxed{B}", "B", {}, PROMPT, "mmlu"))
        assert mmlu.total == 1.5 and [t.name for t in mmlu.terms] == ["choice", "format"]
        other = await scorer.score(Sample(r"\boxed{Paris}", "paris", {}, PROMPT, "trivia"))
        assert other.total == 1.0 and [t.name for t in other.terms] == ["exact"]
    for bad, words in (({"by_source": {"a": "math"}}, "env.reward.default must name"),
                       ({"by_source": {"a": "nope"}, "default": "math"},
                        "env.reward.by_source.a names an unknown reward"),
                       ({"by_source": {}, "default": "math"}, "env.reward.by_source must map")):
        with pytest.raises(EnvConfigError, match=None) as info:
            Scorer(bad)
        assert words in str(info.value) and "\n" not in str(info.value)


async def test_every_way_a_reward_gives_up_is_counted_by_name() -> None:
    """math-verify's own timeout scored 0 uncounted before (timeouts 0, errors 0); a NaN or a
    string raised a TypeError counted with the errors; ours and a raise by kind now."""
    async with Scorer({"math": 1.0}, timeout_s=1.3, processes=1) as scorer:
        reward = await scorer.score(Sample(r"\boxed{9^{9^{9^{9}}}}", "1"))
    assert reward.total == 0.0 and reward.components["failed"] == 1.0
    assert scorer.metrics()["reward/failed/math/own_timeout"] == 1.0
    assert scorer.first_failure is not None and scorer.first_failure.startswith(
        "math: own_timeout: ")
    names = ["returns_nan", "returns_text", "always_raises", "picky"]
    async with Scorer([f"dataset_reward_fns:{n}" for n in names], timeout_s=1.0,
                      processes=1) as scorer:
        await scorer.score(Sample("fine", "x"))
        await scorer.score(Sample("hang", "x"))  # picky hangs: our hard limit
    failed = {k.removeprefix("reward/failed/dataset_reward_fns:"): v
              for k, v in scorer.metrics().items() if k.startswith("reward/failed/")}
    # the hang's item lost its worker, so all its parts count as our timeout
    assert failed == {"returns_nan/invalid": 1.0, "returns_text/invalid": 1.0,
                      "always_raises/error": 1.0, "returns_nan/timeout": 1.0,
                      "returns_text/timeout": 1.0, "always_raises/timeout": 1.0,
                      "picky/timeout": 1.0}


async def test_async_rewards_overlap(tmp_path: Path) -> None:
    """Sixteen 0.5-second async calls with 2 processes once ran two at a time (4 s); an
    async function's calls are bounded by env.reward_concurrency, not env.reward_processes,
    now. Shown by the calls' own intervals, not by a wall-clock bound."""
    log = tmp_path / "calls"
    async with Scorer("dataset_reward_fns:slow_async", processes=2) as scorer:
        await scorer.score(Sample("warm", "", {"sleep_s": 0.0}))
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(scorer.score, Sample(f"{i}", "", {"sleep_s": 0.5, "log": str(log)}))
    calls = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert len(calls) == 16
    # the most calls in flight at once (as one of them started): 2 if processes bounded them
    most = max(sum(1 for s2, e2 in calls if s2 <= s < e2) for s, _ in calls)
    assert most > 2, calls
    assert scorer.metrics()["reward/errors"] == scorer.metrics()["reward/timeouts"] == 0.0


# --- env.reward in every environment, a user's module:function among them --------------------

USER = "dataset_reward_fns:length_share"


async def episode(spec: object, task: object, replies: list[str]) -> object:
    async with spec.running(), spec.make_env() as env:  # type: ignore[attr-defined]
        await env.reset(task)
        for reply in replies:
            step = await env.step(reply)
            if step.done:
                break
        return await env.reward()


async def test_arithmetic_takes_env_reward() -> None:
    from envs.arithmetic import ArithmeticSpec

    spec = ArithmeticSpec(train_size=4, eval_size=0, reward={"exact": 1.0, USER: 0.5})
    task = spec.tasks("train")[0]
    reward = await episode(spec, task, [rf"\boxed{{{task.answer}}}"])
    length = len(rf"\boxed{{{task.answer}}}") / 100
    assert reward.total == pytest.approx(1.0 + 0.5 * length)  # strict, the default, gives 0
    assert spec.metrics()["reward/errors"] == 0.0


async def test_search_qa_takes_env_reward() -> None:
    from envs.search_qa import SearchQASpec

    spec = SearchQASpec(train_size=4, eval_size=0, latency="none",
                        reward={"f1": 1.0, USER: 1.0, "searched": 0.5})
    task = spec.tasks("train")[0]
    reply = f"it is {task.answer}"
    reward = await episode(spec, task, [reply])
    assert [t.name for t in reward.terms] == ["f1", USER, "searched"]
    assert 0 < reward.components["f1"] < 1 and reward.components["searched"] == 0.0
    assert reward.components[USER] == pytest.approx(len(reply) / 100)


@pytest.mark.parametrize("name", ["code", "code_tool"])
async def test_code_takes_env_reward(name: str) -> None:
    from envs.code import CodeSpec, CodeToolSpec

    cls = CodeSpec if name == "code" else CodeToolSpec
    spec = cls(sandbox={"_target_": "sandboxes.local.LocalSandboxConfig", "timeout_s": 2.0,
                        "max_timeout_s": 2.0}, train_size=4, eval_size=0,
               reward={"tests_passed": 1.0, USER: 1.0})
    task = spec.tasks("train")[0]
    reward = await episode(spec, task, [task.answer])
    assert reward.components["tests_passed"] == 1.0
    assert reward.total == pytest.approx(1.0 + len(task.answer) / 100)


async def test_reasoning_gym_takes_env_reward() -> None:
    pytest.importorskip("reasoning_gym")
    from envs.reasoning_gym import ReasoningGymSpec

    spec = ReasoningGymSpec(train_size=2, eval_size=0, reward={USER: 1.0, "verifier": 2.0})
    task = spec.tasks("train")[0]
    reply = f"<answer>{task.answer}</answer>"
    reward = await episode(spec, task, [reply])
    assert reward.total == pytest.approx(len(reply) / 100 + 2.0)


async def test_dataset_takes_env_reward(tmp_path: Path) -> None:
    import json

    from envs.dataset import DatasetSpec

    rows = [{"prompt": "1+1=", "answer": "2", "data_source": "gsm8k", "level": 1},
            {"prompt": "Pick", "answer": "B", "data_source": "mmlu", "level": 2}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DatasetSpec(train=str(path), reward={
        "by_source": {"gsm8k": {"dataset_reward_fns:sees_everything": 1.0, USER: 1.0}},
        "default": "choice"})
    gsm8k, mmlu = spec.tasks("train")
    reward = await episode(spec, gsm8k, ["2"])
    assert reward.total == pytest.approx(1.0 + 0.01)
    assert reward.components["dataset_reward_fns:sees_everything/source_is_gsm8k"] == 1.0
    assert reward.components["dataset_reward_fns:sees_everything/has_level"] == 1.0
    assert (await episode(spec, mmlu, ["The answer is (B)."])).total == 1.0


async def test_an_async_built_in_runs_on_the_callers_loop_under_the_hard_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """How a built-in that waits on I/O (the LLM judge) plugs in: registered in BUILTINS,
    not isolated, awaited in the caller; past env.reward_timeout_s it is a counted timeout."""
    from envs import reward_builtins

    async def slow_judge(completion: str, answer: str, metadata: object) -> float:
        await anyio.sleep(0.0 if completion == answer else 60)
        return 1.0

    monkeypatch.setitem(reward_builtins.BUILTINS, "slow_judge",
                        reward_builtins.Builtin(slow_judge, isolated=False))
    async with Scorer("slow_judge", timeout_s=0.3) as scorer:
        assert (await scorer.score(Sample("a", "a"))).total == 1.0
        started = time.monotonic()
        late = await scorer.score(Sample("a", "b"))
        assert time.monotonic() - started < 2
    assert late.total == 0.0 and late.components["failed"] == 1.0
    assert scorer.metrics()["reward/failed/slow_judge/timeout"] == 1.0
