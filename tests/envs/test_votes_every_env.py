"""Every environment votes by its configured reward (envs.votes.votes_of, what the evaluation
asks): a non-default ``env.reward`` whose reading differs from the environment's own
``extract_answer`` groups the replies as that reward does; a route by data source votes each
task by its own source's route. Each case states what the environment's own reading (the vote
before this change) gives instead."""

from __future__ import annotations

import anyio
import pytest

from envs.arithmetic import ArithmeticSpec
from envs.base import EnvSpec, Task
from envs.code import CodeSpec, CodeToolSpec
from envs.search_qa import SearchQASpec
from envs.votes import Routed, votes_for, votes_of
from orchestrator.pipeline.evaluation import majority, voted
from orchestrator.types import EvalSample

pytestmark = pytest.mark.anyio


async def by_reward(spec: EnvSpec, replies: list[str], threshold: float = 1.0) -> list[int | None]:
    async with votes_of(spec) as votes:
        with anyio.fail_after(60):
            return await votes.for_source(spec.name).groups(replies, {}, threshold)


async def by_own_reading(spec: EnvSpec, replies: list[str]) -> list[int | None]:
    async with spec.votes() as votes:
        return await votes.groups(replies)


async def test_arithmetic_votes_by_env_reward() -> None:
    replies = ["\\boxed{12}", "12.", "13"]
    spec = ArithmeticSpec(train_size=4, eval_size=0, reward="exact")
    assert await by_reward(spec, replies) == [0, 0, 2]
    assert await by_own_reading(spec, replies) == [0, 1, 2]  # the whole reply, stripped
    # the default, strict, reads the whole reply as before
    assert await by_reward(ArithmeticSpec(train_size=4, eval_size=0), replies) == [0, 1, 2]


async def test_arithmetic_votes_by_a_users_function() -> None:
    # the user's reward takes "NYC" for "New York City": one answer, run in its worker
    spec = ArithmeticSpec(train_size=4, eval_size=0, reward="vote_reward_fns:city")
    replies = ["New York City", "Boston", "NYC"]
    assert await by_reward(spec, replies) == [0, 1, 0]
    assert await by_own_reading(spec, replies) == [0, 1, 2]


async def test_search_qa_votes_by_f1() -> None:
    # at threshold 0.5 "Curie" agrees with "Marie Curie" by token F1 (0.67); em and the
    # environment's own reading split them
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none", reward="f1")
    replies = ["Marie Curie", "Curie", "Einstein"]
    assert await by_reward(spec, replies, threshold=0.5) == [0, 0, 2]
    assert await by_own_reading(spec, replies) == [0, 1, 2]
    em = SearchQASpec(train_size=4, eval_size=0, latency="none")
    assert await by_reward(em, replies, threshold=0.5) == [0, 1, 2]


async def test_search_qa_searched_reads_no_answer() -> None:
    # searched is the heavier term but reads no answer: exact votes, on the final text
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none",
                        reward={"searched": 2.0, "exact": 1.0})
    replies = ["<answer>Paris</answer>", "paris", "Rome"]
    assert await by_reward(spec, replies) == [0, 0, 2]
    assert await by_own_reading(spec, replies) == [0, 1, 2]  # SQuAD text keeps the tags


@pytest.mark.parametrize("kind", [CodeSpec, CodeToolSpec])
async def test_code_votes_by_env_reward(kind: type[CodeSpec]) -> None:
    replies = ["\\boxed{4}", "<answer>4</answer>", "5"]
    spec = kind(train_size=4, eval_size=0, reward="exact")
    assert await by_reward(spec, replies) == [0, 0, 2]
    assert await by_own_reading(spec, replies) == [None, None, None]  # programs: no vote
    # the default, tests_passed, reads no answer: still no maj@n
    assert await by_reward(kind(train_size=4, eval_size=0), replies) == [None, None, None]


async def test_reasoning_gym_votes_by_env_reward() -> None:
    pytest.importorskip("reasoning_gym")
    from envs.reasoning_gym import ReasoningGymSpec

    spec = ReasoningGymSpec("basic_arithmetic", train_size=4, eval_size=0, reward="exact")
    replies = ["<answer>7</answer>", "\\boxed{7}", "8"]
    assert await by_reward(spec, replies) == [0, 0, 2]
    assert await by_own_reading(spec, replies) == [0, 1, 2]  # the tags, else the text
    default = ReasoningGymSpec("basic_arithmetic", train_size=4, eval_size=0)
    assert await by_reward(default, replies) == [0, 1, 2]  # verifier: its own reading


async def test_a_route_by_data_source_votes_by_its_own_route() -> None:
    # a "mc" task is scored by choice: "(B)" and "\boxed{B}" are one letter; the default
    # route (exact) would split them and let the first, wrong "(C)" win
    reward = {"by_source": {"mc": "choice"}, "default": "exact"}
    task = Task(id=0, messages=(), answer="B")
    replies, rewards = ["(C)", "(B)", "\\boxed{B}"], [0.0, 1.0, 1.0]
    results = {}
    for source in ("mc", "other"):
        samples = [EvalSample(task_id=0, sample_index=i, source=source, reward=r, tokens=1,
                              answer=None, reply=reply)
                   for i, (reply, r) in enumerate(zip(replies, rewards, strict=True))]
        async with votes_for(reward) as votes:
            assert isinstance(votes, Routed)
            results[source] = majority(await voted(samples, [task], votes, 1.0))
    assert results == {"mc": 1.0, "other": 0.0}
