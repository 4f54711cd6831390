"""Majority votes by a reward's own reading: which answer a reply gives, and which replies give
the same answer, for an evaluation's maj@n (:mod:`orchestrator.evaluate`).

A :class:`Votes` reads a reply's answer (:meth:`Votes.answer`) and groups a task's samples
(:meth:`Votes.groups`): sample ``b`` joins the group of an earlier sample ``a`` when ``b``'s
reply *agrees* with ``a``'s answer. The one rule for agreement is the reward itself: ``b``
agrees with ``a`` when the reward scores ``b``'s reply against ``a``'s answer as a reference
at ``threshold`` or more (the evaluation's ``eval.success_threshold``). So each reward groups
by its own equivalence:

* ``math`` — the answer is math's (:func:`envs.answers.extract_math`), and agreement is
  math-verify's (``\\frac{1}{2}`` and ``0.5`` are one answer), in the reward's isolated
  worker with its hard time limit (:class:`envs.rewards.Scorer`);
* ``choice`` — the answer is the letter the reward reads (``(B)``, ``\\boxed{B}``, "the answer
  is B"); two replies agree when they pick the same letter;
* ``exact`` and ``regex`` — the answer is the final text (boxed, tagged, else the whole reply)
  and agreement is equality after ``exact``'s normalising (case, white space, ``$``, a final
  period): a pattern is no answer to compare with;
* a user's ``module:function`` — the answer is the final text as for ``exact``; ``b`` agrees
  with ``a`` when the function scores ``b``'s reply against ``a``'s answer (with the task's
  metadata) at ``threshold`` or more, run isolated like the reward;
* ``format`` is no reading of an answer: of weighted terms (``{math: 1, format: 0.1}``) the
  heaviest other term votes.

Equal normalised answers always agree without asking the reward (a reward that scores a reply
0 against its own answer would otherwise split every vote). A reply whose answer cannot be read
gives no vote. Groups are formed in sample order: a sample joins the first group whose
answer it agrees with, so a non-transitive agreement cannot merge two groups after the fact.

The base, :class:`envs.base.Votes` (beside :class:`~envs.base.EnvSpec`, whose
:meth:`~envs.base.EnvSpec.votes` gives one), reads answers with a function and lets equal
normalised text agree: an environment whose answers are its own (``arithmetic``,
``search_qa``, ``reasoning_gym``) votes with it and its ``extract_answer``.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

from envs.answers import extract_final, extract_math
from envs.base import Votes
from envs.reward_builtins import BUILTINS, choice_reward
from envs.rewards import JUDGE, Sample, Scorer, parse_reward

__all__ = ["Choice", "Exact", "Scored", "Votes", "votes_for", "voting_term"]


class Choice(Votes):
    """``choice``: the letter the reward reads; the same letter agrees."""

    def __init__(self) -> None:
        super().__init__(extract_final)

    def answer(self, reply: str) -> str | None:
        # the reward's own reading: the letter it would score 1 (at most one can)
        return next((c for c in string.ascii_uppercase if choice_reward(reply, c, {}) == 1.0),
                    None)


class Exact(Votes):
    """``exact`` and ``regex``: the final text; equal normalised text agrees."""

    def __init__(self) -> None:
        super().__init__(extract_final)


class Scored(Votes):
    """``math`` or a user's function: agreement is the reward scoring a reply against another
    sample's answer, through a :class:`~envs.rewards.Scorer` of that one reward (its isolated
    workers, its time limit)."""

    def __init__(self, name: str, timeout_s: float = 10.0, processes: int = 1,
                 extract: Callable[[str], str | None] = extract_final) -> None:
        super().__init__(extract)
        self.name = name
        self._scorer = Scorer(name, timeout_s=timeout_s, processes=processes)
        self._started = False

    async def agree(self, reply: str, answer: str, metadata: Mapping[str, Any],
                    threshold: float) -> bool:
        if not self._started:  # the workers start on the first question, not before: an
            await self._scorer.__aenter__()  # evaluation of one sample a task asks none
            self._started = True
        return (await self._scorer.score(Sample(reply, answer, metadata))).total >= threshold

    async def __aenter__(self) -> Self:
        self._started = False
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._started:
            self._started = False
            await self._scorer.__aexit__(exc_type, exc, tb)


def voting_term(reward: object, key: str = "env.reward") -> str:
    """The reward term that reads answers: the heaviest one that is not ``format`` (the first
    of equal weights); ``format`` itself when it is alone. A route by data source votes by its
    ``default`` route."""
    terms = parse_reward(reward, key).default
    readers = [t for t in terms if t.name != "format"] or list(terms)
    return max(readers, key=lambda t: t.weight).name  # max keeps the first of equal weights


def votes_for(reward: object, timeout_s: float = 10.0, processes: int = 1,
              key: str = "env.reward") -> Votes:
    """The :class:`Votes` of ``env.reward`` (a name, list or weighted mapping)."""
    name = voting_term(reward, key)
    if name == "math":
        return Scored("math", timeout_s, processes, extract=extract_math)
    if name == "choice":
        return Choice()
    if name in BUILTINS or name == JUDGE:  # exact, regex, format (and a judge): the final text
        return Exact()
    return Scored(name, timeout_s, processes)
