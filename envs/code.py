"""Code: the model writes a small Python function; hidden unit tests run in a sandbox.

Tasks are synthetic and described in words, so a tiny model can learn a few of them:
``Write f(x) that returns (x plus 3) times 2.`` → ``def f(x):\\n    return (x+3)*2``. Each
task has hidden tests (inputs drawn from a seed, expected values computed here); the reward
is ``env.reward`` (:mod:`envs.rewards`), by default ``tests_passed``: the fraction that pass, run in a fresh sandbox session with the configured limits: one
program loads the model's code into a namespace of its own, then runs the tests with the
builtins it took beforehand and reports the count after a random marker (see
:func:`test_program` for what that does and does not stop).

Two variants:

* ``code`` — one turn: the reply is the function.
* ``code_tool`` — multi-turn with a ``python`` tool: the model may run code in its episode's
  stateful session (variables persist between calls) and read the output, then answers
  with the function in a turn without tool calls.

The sandbox is the ``sandbox`` config node (``sandbox=docker`` by default, ``sandbox=local`` for
development only, or any backend a ``_target_`` names): built when the spec is (a bad config
fails before anything starts), its pool opened by :meth:`CodeSpec.running` for the whole run. A
model never chooses its own timeout or limits.
"""

from __future__ import annotations

import random
import re
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from envs.base import Env, EnvSpec, Message, Reward, SingleTurnEnv, Task, Votes
from envs.errors import EnvConfigError, EnvNotRunning
from envs.parsers import HermesParser
from envs.reward_functions import Sample
from envs.rewards import Scorer
from envs.tool_env import Episode, ToolEnv, episode_sample
from envs.tools import EpisodeContext, ToolError, ToolOutput, tool
from envs.toolset import ToolSet
from sandboxes.api import ExecResult, SandboxPool
from sandboxes.config import SandboxConfig, sandbox_config

OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "plus": ("+", lambda a, b: a + b),
    "minus": ("-", lambda a, b: a - b),
    "times": ("*", lambda a, b: a * b),
    "mod": ("%", lambda a, b: a % b),
}
_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
    """The code of a reply: the first fenced block when there is one, else the whole reply."""
    fenced = _FENCE.search(reply)
    return fenced.group(1) if fenced else reply


def test_program(code: str, tests: Sequence[tuple[int, int]], marker: str) -> str:
    """One program that loads ``code`` into a namespace of its own and counts the tests its
    ``f`` passes, printing ``<marker> <passed> <loaded>``.

    The builtins it relies on are taken before the model's code runs, a result counts only
    when it is exactly an ``int`` equal to the expected value (an object whose ``__eq__``
    always says yes earns nothing), and the marker is random per call. This stops a model
    that prints a fake score or redefines ``print``/``int``; it does not stop code that
    inspects its caller's frame, which the sandbox contains and the host clamps."""
    return (
        f"_print, _type, _int, _exec, _compile = print, type, int, exec, compile\n"
        f"_tests = {list(tests)!r}\n"
        "_ns, _loaded, _passed = {}, 0, 0\n"
        "try:\n"
        f"    _exec(_compile({code!r}, '<answer>', 'exec'), _ns)\n"
        "    _loaded = 1\n"
        "except BaseException:\n"
        "    pass\n"
        "_f = _ns.get('f')\n"
        "for _x, _y in _tests:\n"
        "    try:\n"
        "        _r = _f(_x)\n"
        "        _passed += _type(_r) is _int and _r == _y\n"
        "    except BaseException:\n"
        "        pass\n"
        f"_print({marker!r}, _int(_passed), _loaded)\n"
    )


def parse_count(result: ExecResult, marker: str, num_tests: int) -> tuple[int, bool]:
    """(tests passed, whether the code loaded) from the marker line; (0, False) without one."""
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == marker:
            try:
                passed, loaded = int(parts[1]), parts[2] == "1"
            except ValueError:
                break
            return min(max(passed, 0), num_tests), loaded
    return 0, False


async def grade(pool: SandboxPool, code: str, tests: Sequence[tuple[int, int]],
                timeout: float) -> tuple[float, dict[str, Any]]:
    """(fraction of ``tests`` passed, what happened) for ``code`` in a fresh sandbox."""
    marker = secrets.token_hex(8)
    async with pool.session() as sandbox:
        result = await sandbox.exec(test_program(code, tests, marker), timeout=timeout)
    passed, loaded = parse_count(result, marker, len(tests))
    info = {"status": result.status, "loaded": loaded, "exec_s": result.duration_s}
    return passed / max(len(tests), 1), info


class CodeEnv(SingleTurnEnv):
    """One turn: the reply is the function, graded at the end."""

    def __init__(self, spec: CodeSpec) -> None:
        super().__init__()
        self.spec = spec

    async def score(self, task: Task, reply: str) -> Reward:
        sample = Sample(reply, task.answer, task.metadata, task.messages, self.spec.name)
        return await self.spec.score(sample, task, reply)


class CodeSpec(EnvSpec):
    name = "code"  # its registry name, also its tasks' data source in evaluations
    multi_turn = False

    def __init__(
        self,
        sandbox: SandboxConfig | Mapping[str, Any] | None = None,
        train_size: int = 480,
        eval_size: int = 96,
        ops: Sequence[str] = ("plus", "minus", "times"),
        max_constant: int = 9,
        num_tests: int = 5,
        test_timeout: float = 5.0,
        seed: int = 0,
        reward: Any = "tests_passed",
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        unknown = [op for op in ops if op not in OPS]
        if unknown or not ops:
            raise EnvConfigError(f"env.ops has unknown operation(s) {unknown}; choose from {list(OPS)}")
        if not 2 <= max_constant <= 99:
            raise EnvConfigError(f"env.max_constant={max_constant} must be from 2 to 99")
        universe = (len(ops) * (max_constant - 1)) ** 2
        if train_size < 1 or eval_size < 0 or train_size + eval_size > universe:
            raise EnvConfigError(f"env.train_size + env.eval_size must be from 1 to {universe} "
                             f"(the distinct tasks with these ops and constants)")
        if num_tests < 1:
            raise EnvConfigError("env.num_tests must be >= 1")
        # a mapping with a _target_ (conf/sandbox/*.yaml), a config, or None (Docker defaults);
        # checked now, opened in running()
        self.sandbox_config = sandbox_config(sandbox)
        # tests_passed: the hidden tests in a sandbox (the environment's own reward)
        self.scorer = Scorer(reward, reward_timeout_s, reward_processes, own=("tests_passed",),
                             concurrency=reward_concurrency,
                             fail_steps=reward_fail_steps, judge=judge)
        self.test_timeout = test_timeout
        self.pool: SandboxPool | None = None
        rng = random.Random(seed)
        constants = range(2, max_constant + 1)
        problems = [(a, k, b, m) for a in ops for k in constants for b in ops for m in constants]
        rng.shuffle(problems)
        tasks = [self._task(i, p, rng, num_tests) for i, p in enumerate(problems[: train_size + eval_size])]
        self.splits = {"train": tasks[:train_size], "eval": tasks[train_size:]}

    @staticmethod
    def _task(index: int, problem: tuple[str, int, str, int], rng: random.Random, n: int) -> Task:
        op1, k1, op2, k2 = problem
        (s1, f1), (s2, f2) = OPS[op1], OPS[op2]
        inputs = rng.sample(range(-20, 21), n)
        tests = [(x, f2(f1(x, k1), k2)) for x in inputs]
        question = f"Write f(x) that returns (x {op1} {k1}) {op2} {k2}."
        answer = f"def f(x):\n    return (x{s1}{k1}){s2}{k2}"
        return Task(id=index, messages=({"role": "user", "content": question},), answer=answer,
                    metadata={"tests": tests})

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.sandbox_config.pool() as pool, self.scorer:
            self.pool = pool
            try:
                yield
            finally:
                self.pool = None

    def metrics(self) -> dict[str, float]:
        return {**(self.pool.metrics() if self.pool is not None else {}),
                **super().metrics()}

    async def score(self, sample: Sample, task: Task, reply: str,
                    diagnostics: Mapping[str, float] | None = None) -> Reward:
        """``env.reward`` on ``sample``; its own ``tests_passed`` grades ``reply`` (reporting
        ``ran_ok`` and ``exec_s`` beside its score)."""

        async def tests_passed() -> Reward:
            score, info = await self.grade(task, reply)
            ran_ok = info["status"] == "ok" and info["loaded"]
            return Reward(score, {"ran_ok": float(ran_ok), "exec_s": info["exec_s"]})

        return await self.scorer.score(sample, {"tests_passed": tests_passed}, diagnostics)

    def _pool(self) -> SandboxPool:
        if self.pool is None:
            raise EnvNotRunning("the code environment's sandbox pool is not running: run its "
                               "episodes inside `async with spec.running():`")
        return self.pool

    async def grade(self, task: Task, reply: str) -> tuple[float, dict[str, Any]]:
        tests = [tuple(t) for t in task.metadata["tests"]]  # type: ignore[attr-defined]
        return await grade(self._pool(), extract_code(reply), tests, self.test_timeout)

    def make_env(self) -> Env:
        self._pool()
        return CodeEnv(self)

    def extract_answer(self, reply: str) -> str | None:
        """None: a reply is a program, not an answer to vote on (no maj@n)."""
        return None

    def own_votes(self) -> Mapping[str, Votes | None]:
        """``tests_passed`` reads no answer to vote on: a reply is a program (no maj@n)."""
        return {"tests_passed": Votes(self.extract_answer)}


class CodeToolSpec(CodeSpec):
    """The multi-turn variant: a ``python`` tool on the episode's own stateful session."""

    name = "code_tool"  # its registry name, also its tasks' data source in evaluations

    def __init__(self, *args: Any, max_calls_per_turn: int = 2, describe_tools: bool = False,
                 system_prompt: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_calls_per_turn = max_calls_per_turn
        self.describe_tools, self.system_prompt = describe_tools, system_prompt

    def make_env(self) -> Env:
        self._pool()  # an operator error, raised here rather than shown to the model
        return self._tool_env()

    def _tool_env(self) -> ToolEnv:
        timeout = self.test_timeout
        spec = self

        @tool(timeout=timeout * 3)
        async def python(code: str, context: EpisodeContext) -> ToolOutput:
            """Run Python in this episode's session (variables persist) and show its output.

            Args:
                code: the program to run
            """
            sandbox = await context.resource("sandbox", spec._pool().session)
            result = await sandbox.exec(code, timeout=timeout)  # the model never sets this
            metadata = {"exec_status": result.status, "exit_code": result.exit_code,
                        "exec_s": result.duration_s, "session_reset": result.session_reset}
            output = (result.stdout + result.stderr).strip() or "(no output)"
            if not result.ok:
                raise ToolError(f"{result.status}, exit code {result.exit_code}: {output}", metadata)
            return ToolOutput(output, metadata)

        async def score(episode: Episode) -> Reward:
            used_python = float(any(call.name == "python" for call in episode.tool_calls))
            return await spec.score(episode_sample(episode, spec.name), episode.task,
                                    episode.final_reply, {"used_python": used_python})

        tools = ToolSet([python], max_calls_per_turn=self.max_calls_per_turn, clock=self.clock)
        return ToolEnv(tools, score, system_prompt=self.system_prompt,
                       describe_tools=self.describe_tools)

    def demonstration(self, task: Task) -> tuple[Message, ...]:
        """Try the function on the first hidden input, read the result, then answer."""
        x, y = task.metadata["tests"][0]  # type: ignore[index]
        probe = f"{task.answer}\nprint(f({x}))"
        return (
            *self._tool_env().opening(task),
            {"role": "assistant", "content": HermesParser.format("python", {"code": probe})},
            {"role": "tool", "content": str(y)},
            {"role": "assistant", "content": task.answer},
        )
