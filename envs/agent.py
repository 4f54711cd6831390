"""Agent programs as environments: ``env=agent env.program=my_agent:run``.

An agent program is code someone already has, written against an OpenAI-compatible client::

    async def run(task: Task, client: openai.AsyncOpenAI) -> float: ...

``client`` is already pointed at this episode: its base URL is the run's gateway and its API
key is the episode's own (:class:`AgentEndpoint`, handed in by the orchestrator as plain
data; this layer never imports it). Every call the program makes with it is recorded, token
by token, into the episode's trajectory; the program's return value is the episode's reward.
A plain ``def run(task, client: openai.OpenAI)`` runs in a worker thread with a synchronous
client. A program may instead return its transcript (a list of OpenAI message dicts) and
leave scoring to ``env.reward`` (:mod:`envs.rewards`: any reward, in worker processes under
``env.reward_timeout_s`` like every environment's), which sees the transcript's last message
as the completion and the whole of it as ``transcript``; a number or an
:class:`~envs.base.Reward` the program returns is taken as it is. (``env.rewards`` and its
``fn(task, transcript)`` are gone: one reward system, one key.)

Tasks come from ``tasks`` (``"pkg.mod:fn"``, ``fn(split) -> iterable``; by default the
``tasks`` of the module ``env.program`` names): :class:`~envs.base.Task` objects, or mappings
with a ``prompt`` (or ``messages``), an ``answer`` and any other keys as metadata.

Failures never stop the run: a program that raises, or runs past ``timeout_s``, ends its
episode as failed with reward 0 (:class:`AgentOutcome` says why; the orchestrator counts
``agent/errors`` and ``agent/timeouts``). A synchronous program past its timeout is abandoned
in its thread (Python cannot stop a thread); its key is revoked with the episode, so its next
call fails and it ends there. The settings from ``host`` on are the gateway's, read by the
orchestrator as plain data.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import httpx

from envs.agent_workers import AgentWorkers, ProgramError
from envs.base import Env, EnvSpec, Reward, Task
from envs.errors import EnvConfigError, EnvError
from envs.reward_functions import Sample
from envs.rewards import Scorer

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class AgentEndpoint:
    """Where an episode's program sends its calls: exactly what an API key and a base URL are
    to any OpenAI client."""

    base_url: str
    api_key: str
    model: str


@dataclass(frozen=True)
class AgentOutcome:
    """How an episode's program ended: its reward (0 when it failed) and why it failed."""

    reward: Reward
    status: Status = "ok"
    error: str | None = None  # the exception's type and message, or what timed out


def load_object(path: str, key: str) -> Any:
    """The object ``path`` names (``pkg.mod:attr`` or ``pkg.mod.attr``); an EnvConfigError naming
    ``key`` when it cannot be found."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise EnvConfigError(f"{key}={path} must name an object as package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvConfigError(f"{key}={path}: module {module_name} cannot be imported ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvConfigError(f"{key}={path}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    return obj


def as_task(index: int, item: Task | Mapping[str, Any]) -> Task:
    if isinstance(item, Task):
        return item
    data = dict(item)
    if "messages" in data:
        messages = tuple(dict(m) for m in data.pop("messages"))
    elif "prompt" in data:
        messages = ({"role": "user", "content": str(data.pop("prompt"))},)
    else:
        raise EnvConfigError(f"env.tasks: item {index} has neither 'prompt' nor 'messages'")
    return Task(id=int(data.pop("id", index)), messages=messages,  # type: ignore[arg-type]
                answer=str(data.pop("answer", "")), metadata=data)


class AgentProgram:
    """The user's program and how to call it: ``run(task, endpoint)`` is one episode with a
    client on ``endpoint``, in this process (an async program on this event loop, a plain one
    in a worker thread). Also what a worker process (``env.processes``) runs."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        if not callable(fn):
            raise TypeError(f"env.program={name} is not callable")
        self.fn, self.name = fn, name
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__)
        self._tls: Any = None  # the clients' one TLS context, built on first use

    @classmethod
    def load(cls, path: str) -> AgentProgram:
        return cls(load_object(path, "env.program"), path)

    def _client_options(self, endpoint: AgentEndpoint, sync: bool, timeout_s: float) -> dict[str, Any]:
        """An episode's client: its own connection pool (one pool shared by hundreds of
        episodes costs each request a scan of all its connections), on one TLS context
        built once (building one costs an episode tens of milliseconds)."""
        openai = _openai()
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        pool = openai.DefaultHttpxClient if sync else openai.DefaultAsyncHttpxClient
        return {"base_url": endpoint.base_url, "api_key": endpoint.api_key, "max_retries": 0,
                "timeout": timeout_s, "http_client": pool(verify=self._tls)}

    async def run(self, task: Task, endpoint: AgentEndpoint, timeout_s: float = 300.0) -> Any:
        """What the program returns for ``task`` (it raises what the program raises)."""
        options = self._client_options(endpoint, sync=not self.is_async, timeout_s=timeout_s)
        if self.is_async:
            async with _openai().AsyncOpenAI(**options) as client:
                return await self.fn(task, client)

        def run() -> Any:
            with _openai().OpenAI(**options) as client:
                return self.fn(task, client)

        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)


class AgentSpec(EnvSpec):
    name = "agent"  # its registry name, also its tasks' data source in evaluations
    runs_programs = True

    def __init__(
        self,
        program: str,
        tasks: str | None = None,
        reward: Any = None,
        rewards: Any = None,
        timeout_s: float = 300.0,
        model: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        max_n: int = 8,
        max_calls: int = 64,
        max_context: int | None = None,
        processes: int = 0,
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        if rewards:
            raise EnvConfigError("env.rewards is replaced by env.reward (the same {package."
                                 "module:fn: weight}); a function takes (completion, answer, "
                                 "metadata, transcript=...) instead of (task, transcript)")
        if timeout_s <= 0:
            raise EnvConfigError(f"env.timeout_s must be > 0, got {timeout_s}")
        for key, value in (("max_n", max_n), ("max_calls", max_calls)):
            if value < 1:
                raise EnvConfigError(f"env.{key} must be >= 1, got {value}")
        if not 0 <= port < 65536:
            raise EnvConfigError(f"env.port must be a TCP port (0: any free one), got {port}")
        if max_context is not None and max_context < 2:
            raise EnvConfigError(f"env.max_context must be >= 2 or null, got {max_context}")
        if processes < 0:
            raise EnvConfigError(f"env.processes must be >= 0 (0: in the run's own process), "
                                 f"got {processes}")
        _openai()  # the programs' client: a missing package is one line now, not every episode
        self.program_path, self.processes = program, processes
        self.program = AgentProgram.load(program)
        # by default the tasks of the module env.program names (the program itself may be
        # defined elsewhere: a bound method, a shared adapter)
        module = program.partition(":")[0] if ":" in program else program.rpartition(".")[0]
        source = tasks or f"{module}:tasks"
        make_tasks = load_object(source, "env.tasks")
        self.splits = {split: self._load(make_tasks, split) for split in ("train", "eval")}
        self.scorer = None if reward is None else Scorer(
            reward, reward_timeout_s, reward_processes, concurrency=reward_concurrency,
            fail_steps=reward_fail_steps, judge=judge)
        self.timeout_s = float(timeout_s)
        self.model, self.host, self.port = model, host, port
        self.max_n, self.max_calls, self.max_context = max_n, max_calls, max_context
        self._logged: set[str] = set()
        self._workers: AgentWorkers | None = None  # while running(), with processes > 0

    @staticmethod
    def _load(make_tasks: Callable[[str], Iterable[Any]] | Mapping[str, Iterable[Any]],
              split: str) -> list[Task]:
        items = make_tasks.get(split, ()) if isinstance(make_tasks, Mapping) else make_tasks(split)
        return [as_task(i, item) for i, item in enumerate(items)]

    def make_env(self) -> Env:
        raise TypeError("an agent program's episodes run through the orchestrator's gateway "
                        "(AgentSpec.run_episode), not through Env.step")

    async def run_episode(self, task: Task, endpoint: AgentEndpoint) -> AgentOutcome:
        """Run the program on ``task`` against ``endpoint``; never raises for what the program
        does (it is user code): a failure is an outcome with reward 0."""
        try:
            with anyio.fail_after(self.timeout_s):
                if self.processes and self._workers is None:
                    raise EnvError("env.processes > 0 runs the programs in worker processes "
                                   "held by spec.running(); run episodes inside it")
                result = await (self._workers.run(task, endpoint) if self._workers is not None
                                else self.program.run(task, endpoint, self.timeout_s))
                return AgentOutcome(await self._score(task, result))
        except TimeoutError:
            return AgentOutcome(Reward(0.0), "timeout",
                                f"the agent program ran past env.timeout_s={self.timeout_s:g}")
        except EnvError:
            raise
        except Exception as e:  # the program is user code: its failure is data
            kind, error = ((e.kind, str(e)) if isinstance(e, ProgramError)
                           else (type(e).__name__, f"{type(e).__name__}: {e}"))
            if kind not in self._logged:  # once per kind, with its traceback
                self._logged.add(kind)
                log.warning("agent program failed (episode recorded with reward 0): %s%s", error,
                            f"\n{e.details}" if isinstance(e, ProgramError) else "",
                            exc_info=None if isinstance(e, ProgramError) else e)
            return AgentOutcome(Reward(0.0), "error", error)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """``env.reward``'s workers; with ``processes`` > 0, the worker processes the programs
        run in."""
        async with super().running():
            if not self.processes:
                yield
                return
            async with AgentWorkers(self.program_path, self.processes,
                                    self.timeout_s).open() as workers:
                self._workers = workers
                try:
                    yield
                finally:
                    self._workers = None

    def metrics(self) -> dict[str, float]:
        restarts = ({"agent/worker_restarts": float(self._workers.restarts)} if self._workers
                    else {})
        return {**restarts, **super().metrics()}

    async def _score(self, task: Task, result: Any) -> Reward:
        if isinstance(result, Reward):
            return result
        if isinstance(result, bool | int | float):
            return Reward(float(result))
        if isinstance(result, list | tuple):
            if self.scorer is None:
                raise TypeError("the agent program returned a transcript, but env.reward names "
                                "no reward to score it")
            transcript = tuple(dict(m) for m in result)
            last = str(transcript[-1].get("content") or "") if transcript else ""
            source = str(task.metadata.get("data_source") or self.name)
            return await self.scorer.score(Sample(last, task.answer, task.metadata,
                                                  task.messages, source, transcript))
        raise TypeError(f"the agent program returned {type(result).__name__}; return a reward "
                        f"(a number or envs.base.Reward) or the transcript (a list of messages)")


def _openai() -> Any:
    try:
        import openai
    except ImportError as e:
        raise EnvConfigError("env=agent hands programs an openai client: pip install -e "
                         "'.[agents]'") from e
    return openai
