"""Rewards by name and verification in worker processes that cannot stall (envs/rewards.py)."""

from __future__ import annotations

import time

import anyio
import pytest

from envs.base import Reward, RewardTerm
from envs.errors import EnvConfigError
from envs.reward_builtins import extract_math, math_reward
from envs.reward_functions import Sample, parse_terms
from envs.rewards import Scorer


@pytest.mark.parametrize(("completion", "answer"), [
    (r"so the answer is \boxed{0.75}", r"\frac{3}{4}"),
    (r"\boxed{\frac{3}{4}}", "0.75"),
    (r"\boxed{\dfrac34}", "3/4"),
    (r"<answer>\{2, 1\}</answer>", r"\{1,2\}"),
    (r"\boxed{(0,1]}", "(0, 1]"),
    (r"\boxed{[1, 3)}", r"$[1,3)$"),
    ("First 3 apples, then 2 more: 5", "5"),
    ("so 1,234 in all", "1234"),
    (r"\boxed{x = 5}", "5"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{\text{Paris}}", "Paris"),
    (r"\boxed{12} at first, but then \boxed{13}", "13"),
    (r"\boxed{\boxed{7}}", r"\boxed{7}"),
    (r"\boxed{12", "12"),  # a box never closed: the last number is read
])
def test_math_equivalences(completion: str, answer: str) -> None:
    assert math_reward(completion, answer, {}) == 1.0


@pytest.mark.parametrize(("completion", "answer"), [
    ("I do not know", "5"),  # nothing extractable: 0, never the whole text
    ("five", "five"),  # a bare word is not an answer to compare
    (r"\boxed{0.76}", r"\frac{3}{4}"),
    (r"\boxed{13} then 12", "12"),  # the boxed answer wins over a later number
    (r"\boxed{(0,1)}", "(0, 1]"),
    (r"\boxed{\{1, 2, 3\}}", r"\{1,2\}"),
])
def test_math_non_answers(completion: str, answer: str) -> None:
    assert math_reward(completion, answer, {}) == 0.0


def test_extraction_order() -> None:
    assert extract_math(r"<answer>3</answer> \boxed{4} 5") == "4"
    assert extract_math("<answer>3</answer> then 5") == "3"
    assert extract_math("it is 5, not -2.5") == "-2.5"
    assert extract_math("no digits at all") is None


@pytest.mark.anyio
async def test_builtins_and_weighted_sum() -> None:
    async with Scorer({"exact": 1.0, "format": 0.1}) as scorer:
        assert (await scorer.score(Sample(r" \boxed{Paris}. ", "paris"))).total == pytest.approx(1.1)
        assert (await scorer.score(Sample("Paris", "paris"))).components == {"exact": 1.0, "format": 0.0}
    async with Scorer(["choice", "regex"]) as scorer:
        assert (await scorer.score(Sample("The answer is (B).", "B) blue"))).components["choice"] == 1.0
        assert (await scorer.score(Sample(r"\boxed{C}", "B"))).components["choice"] == 0.0
        assert (await scorer.score(Sample("<answer>42 m</answer>", r"42\s*m(eters)?"))).components[
            "regex"] == 1.0
    async with Scorer({"dataset_reward_fns:length_bonus": 2.0,
                       "dataset_reward_fns:async_named": 1.0}) as scorer:
        reward = await scorer.score(Sample("it is 7", "7", {"difficulty": "easy"}))
        # the weighted terms travel typed; what a function reports beside its score
        # (async_named/half) is a component, logged, and never a term
        assert reward == Reward(total=2.5, components={
            "dataset_reward_fns:length_bonus": 1.0, "dataset_reward_fns:async_named": 0.5,
            "dataset_reward_fns:async_named/half": 0.5}, terms=(
            RewardTerm("dataset_reward_fns:length_bonus", 2.0, 1.0),
            RewardTerm("dataset_reward_fns:async_named", 1.0, 0.5)))


def test_a_reward_with_terms_is_their_weighted_sum() -> None:
    reward = Reward.weighted([RewardTerm("math", 1.0, 1.0), RewardTerm("format", 0.1, 1.0)],
                             {"verifier_error": 1.0})
    assert reward.total == pytest.approx(1.1)
    assert reward.components == {"math": 1.0, "format": 1.0, "verifier_error": 1.0}
    assert [t.name for t in reward.terms] == ["math", "format"]
    with pytest.raises(ValueError, match="weighted sum of its terms"):
        Reward(2.0, terms=(RewardTerm("math", 1.0, 1.0),))


@pytest.mark.parametrize(("value", "message"), [
    ("nope", "env.reward names an unknown reward 'nope'"),
    ("no_such_module_xyz:fn", "env.reward: cannot import no_such_module_xyz"),
    ("dataset_reward_fns:missing", "dataset_reward_fns has no missing"),
    ("dataset_reward_fns:wrong_signature", "fits none of the three conventions"),
    ("dataset_reward_fns:not_a_function", "is not a function"),
    ({"math": "high"}, "env.reward.math must be a number"),
    ([], "names no reward"),
])
def test_bad_reward_names_are_one_line(value: object, message: str) -> None:
    with pytest.raises(EnvConfigError, match=None) as info:
        parse_terms(value)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.anyio
async def test_hang_crash_and_raise_score_zero_counted_and_scoring_goes_on() -> None:
    """One worker: each failure must be survived by replacing it, or later items would wait."""
    async with Scorer({"dataset_reward_fns:picky": 1.0, "exact": 1.0}, timeout_s=1.0,
                      processes=1) as scorer:
        assert (await scorer.score(Sample("fine 7", "fine 7"))).total == 2.0
        started = time.monotonic()
        hung = await scorer.score(Sample("hang", "hang"))
        assert time.monotonic() - started < 5
        assert hung.components == {"dataset_reward_fns:picky": 0.0, "exact": 1.0, "failed": 1.0}
        assert (await scorer.score(Sample("crash", "x"))).total == 0.0
        assert (await scorer.score(Sample("raise", "x"))).total == 0.0
        failed = {"reward/failed/dataset_reward_fns:picky/timeout": 1.0,
                  "reward/failed/dataset_reward_fns:picky/error": 2.0,
                  "reward/timeouts": 1.0, "reward/errors": 2.0, "reward/spared": 0.0}
        assert scorer.metrics() == failed  # a user's function: always asked
        # the replaced workers score again, several items at once
        results = []

        async def one(i: int) -> None:
            results.append((await scorer.score(Sample(f"ok {i}", f"ok {i}"))).total)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        assert results == [2.0] * 6
    assert scorer.metrics() == failed


@pytest.mark.anyio
async def test_the_event_loop_runs_while_a_verification_hangs() -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    async with (Scorer("dataset_reward_fns:picky", timeout_s=1.0, processes=2) as scorer,
                anyio.create_task_group() as tg):
        tg.start_soon(tick)
        assert (await scorer.score(Sample("hang", ""))).total == 0.0
        tg.cancel_scope.cancel()
    assert ticks >= 10


def test_math_decides_in_the_caller_only_where_no_parser_is_needed() -> None:
    from envs.reward_builtins import math_quick

    assert math_quick("so \\boxed{16}", "16") == 1.0
    assert math_quick("it is 0.50", "0.5") == 1.0  # plain numbers, as numbers
    assert math_quick("it is -3", "3") == 0.0
    assert math_quick("no answer here", "3") == 0.0  # nothing extractable
    assert math_quick("\\boxed{\\frac{3}{4}}", "0.75") is None  # math-verify's job
    assert math_quick("\\boxed{1,000}", "1000") is None


@pytest.mark.anyio
async def test_math_spares_the_workers_what_it_knows_and_what_it_scored_before() -> None:
    async with Scorer("math", timeout_s=5.0, processes=1) as scorer:
        assert (await scorer.score(Sample("\\boxed{16}", "16"))).total == 1.0  # decided here
        assert (await scorer.score(Sample("\\boxed{\\frac{3}{4}}", "0.75"))).total == 1.0  # a worker
        assert (await scorer.score(Sample("\\boxed{\\frac{3}{4}}", "0.75"))).total == 1.0  # kept
        assert (await scorer.score(Sample("\\boxed{\\frac{1}{4}}", "0.75"))).total == 0.0  # a worker
        assert scorer.metrics()["reward/spared"] == 2.0


@pytest.mark.anyio
async def test_a_hung_verification_holds_only_its_own_item() -> None:
    """One worker and a hang: the items after it get a forked spare and finish long before the
    hang's limit; the zygote that forks workers is the same interpreter throughout."""
    finished: list[str] = []

    async def score(scorer: Scorer, text: str) -> None:
        await scorer.score(Sample(text, text))
        finished.append(text)

    async with Scorer("dataset_reward_fns:picky", timeout_s=4.0, processes=1) as scorer:
        pool = scorer._pools[False]
        assert pool is not None
        await scorer.score(Sample("warm", "warm"))
        zygote = pool._zygote.process.pid if pool._zygote else None
        async with anyio.create_task_group() as tg:
            tg.start_soon(score, scorer, "hang")
            await anyio.sleep(0.1)
            for i in range(4):
                tg.start_soon(score, scorer, f"ok {i}")
        assert finished[-1] == "hang" and sorted(finished[:-1]) == [f"ok {i}" for i in range(4)]
        assert scorer.metrics()["reward/timeouts"] == 1.0
        await scorer.score(Sample("crash", ""))  # a dead worker is replaced by a fork too
        assert (await scorer.score(Sample("ok", "ok"))).total == 1.0
        assert pool._zygote is not None and pool._zygote.process.pid == zygote
        assert pool._alive <= pool.processes
