"""Majority votes by the reward's own reading (envs/votes.py, through
orchestrator.pipeline.evaluation): on hand-made replies, for ``math``, ``choice``, ``exact`` and a
user's reward, maj@n is the mean reward of the largest group of replies the reward counts as one
answer, worked out here by hand; each case is one the vote by ``math``'s reading and raw strings got
wrong."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from envs.base import Task
from envs.votes import Choice, Exact, Scored, Votes, votes_for, voting_term
from orchestrator.pipeline.evaluation import majority, voted
from orchestrator.types import EvalSample

pytestmark = pytest.mark.anyio


async def maj_and_mean(reward: object, replies: list[str], rewards: list[float],
                       metadata: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """One task's maj@n and mean@n with ``replies`` scored ``rewards`` (what the reward gives
    each against the reference, written by hand), voted as ``env.reward=reward`` votes."""
    task = Task(id=0, messages=(), answer="", metadata=dict(metadata or {}))
    samples = [EvalSample(task_id=0, sample_index=i, source="s", reward=r, tokens=1,
                          answer=None, reply=reply)
               for i, (reply, r) in enumerate(zip(replies, rewards, strict=True))]
    async with votes_for(reward, timeout_s=20.0) as votes:
        with anyio.fail_after(60):
            grouped = await voted(samples, [task], votes, threshold=1.0)
    value = majority(grouped)
    assert value is not None
    return value, sum(rewards) / len(rewards)


async def test_math_groups_by_math_verify() -> None:
    # reference 1/2: "1/3" first, then ½ written two ways. By raw strings three answers tie
    # and the first, wrong, wins (maj 0); math-verify makes ½ the majority
    replies = ["so \\boxed{1/3}", "\\boxed{\\frac{1}{2}}", "that is \\boxed{0.5}"]
    maj, mean = await maj_and_mean("math", replies, [0.0, 1.0, 1.0])
    assert maj == 1.0 and mean == pytest.approx(2 / 3)


async def test_choice_votes_on_the_letter() -> None:
    # the case: two right "(B)" and one wrong "(C), since 2 > 1"; math's reading gave
    # votes None, None, "1" and maj@3 = 0
    maj, mean = await maj_and_mean("choice", ["(B)", "(B)", "(C), since 2 > 1"],
                                   [1.0, 1.0, 0.0])
    assert maj == 1.0 and mean == pytest.approx(2 / 3)
    # "the answer is B" and "\boxed{B}" are the same letter
    async with Choice() as votes:
        assert await votes.groups(["The answer is (C).", "\\boxed{b}", "B", "no idea"]) == \
            [0, 1, 1, None]


async def test_exact_votes_on_normalised_text() -> None:
    # text answers: math's reading found no number in any, so nobody voted (maj 0)
    maj, mean = await maj_and_mean({"exact": 1.0, "format": 0.1},
                                   ["London", "Paris", "paris.", "<answer>PARIS</answer>"],
                                   [0.0, 1.0, 1.0, 1.0])
    assert maj == 1.0 and mean == 0.75
    async with Exact() as votes:
        assert await votes.groups(["  New  York ", "new york.", "$new york$"]) == [0, 0, 0]


async def test_a_user_reward_groups_what_it_scores_as_the_same_answer() -> None:
    # "NYC" is "New York City" to the user's reward, not to a string comparison: by text the
    # two tie with "Boston" and the first, wrong one wins
    replies = ["Boston", "New York City", "NYC"]
    maj, mean = await maj_and_mean("vote_reward_fns:city", replies, [0.0, 1.0, 1.0])
    assert maj == 1.0 and mean == pytest.approx(2 / 3)
    # the task's metadata reaches the reward: a strict row does not take the nickname
    maj, _ = await maj_and_mean("vote_reward_fns:city", replies, [0.0, 1.0, 0.0],
                                {"strict": True})
    assert maj == 0.0


async def test_groups_form_in_sample_order_and_no_answer_is_no_vote() -> None:
    async with votes_for("math", timeout_s=20.0) as votes:
        with anyio.fail_after(60):
            groups = await votes.groups(["\\boxed{2}", "no answer here", "\\boxed{3}",
                                         "\\boxed{2.0}", "\\boxed{\\frac{6}{2}}"])
    assert groups == [0, None, 2, 0, 2]


def test_which_term_votes() -> None:
    assert voting_term("math") == "math"
    assert voting_term({"format": 1.0, "choice": 0.5}) == "choice"  # format reads no answer
    assert voting_term(["exact", "math"]) == "exact"  # equal weights: the first
    assert voting_term("format") == "format"
    assert isinstance(votes_for("regex"), Exact) and isinstance(votes_for("choice"), Choice)
    assert isinstance(votes_for({"math": 1, "format": 0.5}), Scored)


async def test_an_environment_s_own_reading_votes_by_its_text() -> None:
    votes = Votes(lambda reply: reply.split()[-1] if reply.split() else None)
    assert await votes.groups(["is 12", "says 12.", "is 13", ""]) == [0, 0, 2, None]
