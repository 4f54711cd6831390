"""Majority votes by a reward's own reading: which answer a reply gives, and which replies give
the same answer, for an evaluation's maj@n (:mod:`orchestrator.pipeline.evaluation`).

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
* ``exact`` and ``regex`` (and ``judge``) — the answer is the final text (boxed, tagged, else
  the whole reply) and agreement is equality after ``exact``'s normalising (case, white space,
  ``$``, a final period): a pattern (or a judge's grade) is no answer to compare with;
* ``strict`` — the whole reply, stripped; equal text agrees;
* ``em`` and ``f1`` — the whole reply, SQuAD-normalised; ``f1`` agrees at a token F1 of
  ``threshold`` or more;
* a user's ``module:function`` — the answer is the final text as for ``exact``; ``b`` agrees
  with ``a`` when the function scores ``b``'s reply against ``a``'s answer (with the task's
  metadata) at ``threshold`` or more, run isolated like the reward;
* an environment's own reward reads as the environment says (:meth:`envs.base.EnvSpec.own_votes`:
  reasoning_gym's ``verifier`` by its ``env.answer`` reading, code's ``tests_passed`` gives no
  answer, so no maj@n); ``format`` and search_qa's ``searched`` read no answer: of weighted terms
  (``{math: 1, format: 0.1}``) the heaviest other term votes.

Every environment scored by ``env.reward`` votes this way (:func:`votes_of`, what the evaluation
asks); a route by data source (``{by_source: …, default: …}``) votes each task by its own
source's route (:class:`Routed`), not the default's. Equal normalised answers always agree
without asking the reward (a reward that scores a reply 0 against its own answer would
otherwise split every vote). A reply whose answer cannot be read gives no vote. Groups are
formed in sample order: a sample joins the first group whose answer it agrees with, so a
non-transitive agreement cannot merge two groups after the fact.

The base, :class:`envs.base.Votes`, reads answers with a function and lets equal normalised text
agree: an environment without ``env.reward`` (a plugin's own scoring) votes with its
:meth:`~envs.base.EnvSpec.votes`, by default its ``extract_answer``.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

from envs.answers import extract_final, extract_math
from envs.base import EnvSpec, Votes
from envs.reward_builtins import BUILTINS, choice_reward, f1_reward, squad_normalise
from envs.reward_functions import JUDGE, Routes, Sample, parse_reward
from envs.rewards import Scorer

__all__ = ["Choice", "Exact", "InCaller", "Routed", "Scored", "Votes", "reading", "votes_for",
           "votes_of", "voting_term"]


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


class InCaller(Votes):
    """A plain built-in in the caller (``f1``): agreement is the reward scoring one reply
    against another's answer, at once (it cannot hang)."""

    def __init__(self, extract: Callable[[str], str | None],
                 fn: Callable[[str, str, Mapping[str, Any]], float]) -> None:
        super().__init__(extract)
        self._fn = fn

    async def agree(self, reply: str, answer: str, metadata: Mapping[str, Any],
                    threshold: float) -> bool:
        return self._fn(reply, answer, metadata) >= threshold


class Routed(Votes):
    """``{by_source: …, default: …}``: each data source's own route's votes, the default's for
    every other source (:meth:`for_source`)."""

    def __init__(self, default: Votes, by_source: Mapping[str, Votes]) -> None:
        super().__init__(default.answer)
        self.default, self.by_source = default, dict(by_source)
        self._stack = AsyncExitStack()

    def for_source(self, source: str) -> Votes:
        return self.by_source.get(source, self.default)

    async def groups(self, replies: Sequence[str], metadata: Mapping[str, Any] | None = None,
                     threshold: float = 1.0) -> list[int | None]:
        return await self.default.groups(replies, metadata, threshold)

    async def __aenter__(self) -> Self:
        self._stack = AsyncExitStack()
        async with AsyncExitStack() as stack:
            for votes in {id(v): v for v in (self.default, *self.by_source.values())}.values():
                await stack.enter_async_context(votes)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)


NOT_READERS = frozenset({"format"})  # terms that read no answer: never the voting term


def voting_term(reward: object, key: str = "env.reward", source: str | None = None,
                not_readers: Collection[str] = NOT_READERS) -> str:
    """The reward term that reads answers: the heaviest one that is not ``format`` (nor another
    of ``not_readers``; the first of equal weights), ``format`` itself when it is alone. A
    route by data source votes by ``source``'s route (None: the ``default``)."""
    routes = reward if isinstance(reward, Routes) else parse_reward(reward, key)
    terms = routes.default if source is None else routes.terms(source)
    readers = [t for t in terms if t.name not in not_readers] or list(terms)
    return max(readers, key=lambda t: t.weight).name  # max keeps the first of equal weights


def reading(name: str, timeout_s: float = 10.0, processes: int = 1,
            own: Mapping[str, Votes | None] | None = None) -> Votes:
    """The :class:`Votes` of the one reward ``name``: a built-in's reading, an environment's own
    reward's (``own``), or a user's function scoring one reply against another's answer."""
    own = own or {}
    if name in own:
        return own[name] or Exact()
    if name == "math":
        return Scored("math", timeout_s, processes, extract=extract_math)
    if name == "choice":
        return Choice()
    if name == "strict":
        return Votes(str.strip)
    if name == "em":
        return Votes(squad_normalise)
    if name == "f1":
        return InCaller(squad_normalise, f1_reward)
    if name in BUILTINS or name == JUDGE:  # exact, regex, format (and a judge): the final text
        return Exact()
    return Scored(name, timeout_s, processes)


def votes_for(reward: object, timeout_s: float = 10.0, processes: int = 1,
              key: str = "env.reward", own: Mapping[str, Votes | None] | None = None) -> Votes:
    """The :class:`Votes` of ``env.reward`` (a name, list, weighted mapping or a route by data
    source, parsed or not); ``own``: the environment's own rewards' readings (None: reads no
    answer)."""
    own = own or {}
    routes = reward if isinstance(reward, Routes) else parse_reward(reward, key, tuple(own))
    skip = NOT_READERS | {n for n, v in own.items() if v is None}
    made: dict[str, Votes] = {}  # one Votes per reading term, shared by the routes naming it

    def of(source: str | None) -> Votes:
        name = voting_term(routes, key, source, skip)
        if name not in made:
            made[name] = reading(name, timeout_s, processes, own)
        return made[name]

    default = of(None)
    if not routes.by_source:
        return default
    return Routed(default, {source: of(source) for source in routes.by_source})


def votes_of(spec: EnvSpec) -> Votes:
    """How ``spec``'s evaluation votes: by ``env.reward``'s reading and equivalence wherever the
    environment is scored by it (every built-in environment), else by the spec's own
    :meth:`~envs.base.EnvSpec.votes`."""
    scorer = spec.scorer
    if not isinstance(scorer, Scorer):
        return spec.votes()
    return votes_for(scorer.routes, scorer.timeout_s, own=spec.own_votes())
