"""Search QA: questions about made-up people that only a search can answer.

The knowledge base is synthetic: each person has an invented name, an invented home town and
a job, written as one document (``koravi lives in tesumo and works as a baker.``). A
question asks for the town or the job. The names and towns are random syllables, so no
model knows them; train and eval use different people, so the eval split can be answered
only by searching, never from memory.

An episode is multi-turn: the model calls ``search`` (Hermes format,
``<tool_call>{"name":"search","arguments":{"query":"Where does koravi live?"}}</tool_call>``),
reads the results, then answers in plain text. The search tool talks HTTP to the mock search server
(:mod:`sandboxes.search`) with a per-episode client: an in-process server on an ephemeral
port with the PolyTrace latency model, held by ``spec.running()`` on the run's own event loop
(asyncio: the server is aiohttp's), or an external one at ``search_url``. A failed search (after the client's retries) is an error
observation; the episode goes on.

Reward: ``env.reward`` (:mod:`envs.rewards`), by default ``em`` (exact match after SQuAD-style
normalisation; ``f1`` is token F1), the episode's transcript handed to it; its own
``searched`` (whether a search call came before the answer) is a reward a config may weigh and
is always logged.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

from envs.base import Env, EnvSpec, Message, Reward, Task, Votes
from envs.errors import EnvConfigError, EnvError, EnvNotRunning
from envs.parsers import HermesParser
from envs.reward_builtins import em_reward, f1_reward, squad_normalise
from envs.rewards import Scorer
from envs.tool_env import Episode, ToolEnv, episode_sample
from envs.tools import EpisodeContext, ToolError, ToolOutput, tool
from envs.toolset import ToolSet
from sandboxes.search.bm25 import BM25Index, Document
from sandboxes.search.client import Attempt, SearchClient, SearchError
from sandboxes.search.latency import TraceFaultModel
from sandboxes.search.server import FaultModel, NoFaults, SearchServer, WithFailures

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
JOBS = ("baker", "farmer", "miller", "weaver", "potter", "smith", "tailor", "fisher", "mason",
        "healer")
QUESTIONS = {"town": "Where does {name} live?", "job": "What is the job of {name}?"}


def _word(rng: random.Random, syllables: int) -> str:
    # lower case: a capital letter appears nowhere else, and a character-level model copies
    # it far worse than letters it sees everywhere (it missed the first letter of a third of
    # the names it searched for, when they were capitalised)
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _unique_words(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        w = _word(rng, syllables)
        if w not in taken:
            taken.add(w)
            words.append(w)
    return words


# -- answers ----------------------------------------------------------------------------------

normalize = squad_normalise  # what the reward compares, for maj@n


def exact_match(prediction: str, answer: str) -> float:
    return em_reward(prediction, answer, {})


def f1(prediction: str, answer: str) -> float:
    return f1_reward(prediction, answer, {})


def format_hits(documents: Sequence[dict]) -> str:
    """What the model reads: each document's text (its title line dropped), one per line."""
    texts = [str(d.get("contents", "")).split("\n", 1)[-1] for d in documents]
    return "\n".join(texts) if texts else "no results"


tool_call_text = HermesParser.format

# -- the environment --------------------------------------------------------------------------

class SearchQASpec(EnvSpec):
    name = "search_qa"  # its registry name, also its tasks' data source in evaluations

    def __init__(
        self,
        train_size: int = 2000,
        eval_size: int = 200,
        questions: Sequence[str] = ("town", "job"),
        topk: int = 1,
        reward: Any = "em",
        latency: Literal["none", "empirical", "parametric"] = "empirical",
        time_scale: float = 0.1,
        failure_rate: float = 0.0,
        search_url: str | None = None,
        request_timeout: float = 5.0,
        slow_request_s: float | None = 1.0,
        retries: int = 3,
        backoff: float = 0.05,
        tool_timeout: float = 30.0,
        max_calls_per_turn: int = 2,
        describe_tools: bool = False,
        system_prompt: str | None = None,
        seed: int = 0,
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        unknown = [q for q in questions if q not in QUESTIONS]
        if unknown or not questions:
            raise EnvConfigError(f"env.questions has unknown kind(s) {unknown}; choose from {list(QUESTIONS)}")
        if train_size < 1 or eval_size < 0:
            raise EnvConfigError("env.train_size must be >= 1 and env.eval_size >= 0")
        if not 1 <= topk <= 10:
            raise EnvConfigError(f"env.topk={topk} must be from 1 to 10")
        if not 0.0 <= failure_rate <= 1.0:
            raise EnvConfigError(f"env.failure_rate={failure_rate} must be in [0, 1]")
        if time_scale < 0:
            raise EnvConfigError(f"env.time_scale={time_scale} must be >= 0")
        self.scorer = Scorer(reward, reward_timeout_s, reward_processes, own=("searched",),
                             concurrency=reward_concurrency,
                             fail_steps=reward_fail_steps, judge=judge)
        self.topk, self.latency = topk, latency
        self.time_scale, self.failure_rate, self.search_url = time_scale, failure_rate, search_url
        self.request_timeout, self.retries, self.backoff = request_timeout, retries, backoff
        self.slow_request_s = slow_request_s
        self.tool_timeout, self.max_calls_per_turn = tool_timeout, max_calls_per_turn
        self.describe_tools, self.system_prompt = describe_tools, system_prompt
        self.seed = seed

        rng = random.Random(seed)
        people = train_size + eval_size
        taken: set[str] = set()
        names = _unique_words(rng, people, 3, taken)
        towns = _unique_words(rng, max(50, people // 4), 3, taken)
        facts = [(name, rng.choice(towns), rng.choice(JOBS)) for name in names]
        self.documents = [
            Document(str(i), f'"{name}"\n{name} lives in {town} and works as a {job}.')
            for i, (name, town, job) in enumerate(facts)
        ]
        self.index = BM25Index(self.documents)
        tasks = []
        for i, (name, town, job) in enumerate(facts):
            kind = rng.choice(list(questions))
            question = QUESTIONS[kind].format(name=name)
            tasks.append(Task(id=i, messages=({"role": "user", "content": question},),
                              answer=town if kind == "town" else job,
                              metadata={"name": name, "kind": kind}))
        self.splits = {"train": tasks[:train_size], "eval": tasks[train_size:]}
        self._server: SearchServer | None = None  # the in-process one, while running()
        self.faults: Counter[str] = Counter()  # failed search attempts, by kind

    # -- the service --------------------------------------------------------------------------

    def _faults(self) -> FaultModel:
        base: FaultModel = NoFaults() if self.latency == "none" else TraceFaultModel(self.latency, seed=self.seed)
        return WithFailures(base, self.failure_rate, seed=self.seed) if self.failure_rate else base

    @property
    def url(self) -> str:
        """The search server's address: ``search_url``, or the in-process server's while
        :meth:`running` holds it."""
        if self.search_url:
            return self.search_url
        if self._server is None:
            raise EnvNotRunning("the search_qa environment's search server is not running: run "
                                "its episodes inside `async with spec.running():`")
        return self._server.url

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The in-process search server (unless ``search_url`` names one), serving on the
        caller's event loop until the block ends."""
        async with self.scorer:
            if self.search_url:
                yield
                return
            async with self._serving():
                yield

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        if self._server is not None:
            raise EnvError("the search_qa environment is already running: enter spec.running() once")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise EnvError("the search_qa environment's in-process search server (aiohttp) needs "
                           "anyio's asyncio backend; under another, set env.search_url to an "
                           "external server") from None
        async with SearchServer(self.index, self._faults(), time_scale=self.time_scale) as server:
            self._server = server
            try:
                yield
            finally:
                self._server = None

    # -- episodes -----------------------------------------------------------------------------

    def make_env(self) -> Env:
        self.url  # noqa: B018 - raises unless the server runs: fail at the episode's start
        return self._env()

    def extract_answer(self, reply: str) -> str | None:
        """The final reply, normalised as the reward compares it."""
        return normalize(reply) or None

    def own_votes(self) -> Mapping[str, Votes | None]:
        """``searched`` (a search came first) reads no answer: ``em`` or ``f1`` beside it
        votes."""
        return {"searched": None}

    def _env(self) -> ToolEnv:
        topk = self.topk
        spec = self

        @tool(timeout=self.tool_timeout)
        async def search(query: str, context: EpisodeContext) -> ToolOutput:
            """Search the knowledge base about people.

            Args:
                query: words to look for, e.g. a name
            """
            client = await context.resource("search_client", lambda: SearchClient(
                spec.url, timeout=spec.request_timeout, retries=spec.retries, backoff=spec.backoff))
            try:
                results, attempts = await client.retrieve([query], topk=topk, return_scores=False)
            except SearchError as e:
                spec._count(e.attempts)
                raise ToolError(str(e), {"query_count": 1, "attempts": len(e.attempts),
                                         "attempt_statuses": [a.status for a in e.attempts]}) from e
            spec._count(attempts)
            content = format_hits(results[0])
            return ToolOutput(content, {"query_count": 1, "attempts": len(attempts),
                                        "attempt_statuses": [a.status for a in attempts],
                                        "response_chars": len(content)})

        async def score(episode: Episode) -> Reward:
            searched = float(any(call.name == "search" for call in episode.tool_calls))

            async def own() -> float:
                return searched

            return await spec.scorer.score(episode_sample(episode, spec.name),
                                           {"searched": own}, {"searched": searched})

        return ToolEnv(ToolSet([search], max_calls_per_turn=self.max_calls_per_turn,
                               clock=self.clock),
                       score, system_prompt=self.system_prompt, describe_tools=self.describe_tools)

    def _count(self, attempts: Sequence[Attempt]) -> None:
        for attempt in attempts:
            if attempt.status.startswith("http_5"):
                self.faults["faults/search_errors"] += 1
            elif attempt.status in ("timeout", "connection_error"):
                self.faults[f"faults/search_{attempt.status}s"] += 1
            elif self.slow_request_s is not None and attempt.latency >= self.slow_request_s:
                self.faults["faults/search_slow"] += 1

    def metrics(self) -> dict[str, float]:
        """Failed search attempts (each retried, up to ``retries``): answered 5xx
        (``faults/search_errors``), unanswered in ``request_timeout``
        (``faults/search_timeouts``), not connected (``faults/search_connection_errors``); and
        answers that came but took ``slow_request_s`` or longer (``faults/search_slow``)."""
        return {**{key: float(n) for key, n in self.faults.items()}, **super().metrics()}

    def demonstration(self, task: Task) -> tuple[Message, ...]:
        """Search with the question itself, read the hit, answer. (Searching the question, not
        the bare name, lets a small model copy the name letter by letter, each letter cued by
        the one before; copying just the name from mid-question, it gets the first letter
        wrong often enough that half its searches find nothing.)"""
        query = task.messages[-1]["content"]
        hits = [d.as_json() for d, _ in self.index.search(query, self.topk)]
        return (
            *self._env().opening(task),
            {"role": "assistant", "content": tool_call_text("search", {"query": query})},
            {"role": "tool", "content": format_hits(hits)},
            {"role": "assistant", "content": task.answer},
        )
