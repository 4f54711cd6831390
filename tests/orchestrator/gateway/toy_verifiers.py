"""A verifiers (0.4) environment written as its authors would, for the gateway tests: a
taskset of sums from an in-memory list (train and eval disjoint), each task scored by its own
``@vf.reward`` (the toy objective: the share of digits in the final reply, 1.0 for the exact
sum), and a harness that plays the seat with a tool loop. Verifiers' taskset id is this
module (it exports the taskset and, bundled with it, the harness).

The harness runs in-process, as verifiers allows ("a harness may run its loop in-process
instead of launching a program, as long as every model call goes through ``endpoint`` +
``secret``"): verifiers' own harnesses (``null``, ``bash``) launch a PEP 723 script through
``uv``, which must install its dependencies from PyPI on first use, and start a Python
process per episode. Everything else is verifiers' own: ``SingleAgentEnv``, its rollout, the
interception server relaying each call upstream, the trace and its scoring.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from toy_agents import ADD_TOOL, digit_share, tool_results
from verifiers.v1.harnesses.utils import core
from verifiers.v1.runtimes import ProgramResult, Runtime

from envs.agent_verifiers import VerifiersProgram

__all__ = ["Calculator", "Sums"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return 1.0 if reply == self.data.answer else digit_share(reply)


class SumsConfig(vf.TasksetConfig):
    split: str = "train"


class Sums(vf.Taskset[SumTask, SumsConfig]):
    def load(self) -> list[SumTask]:
        pairs = [(a, b) for a in range(10) for b in range(10)]
        chosen = pairs[:80] if self.config.split == "train" else pairs[80:]
        return [SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
                for a, b in chosen]


@functools.cache
def tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


class CalculatorConfig(vf.HarnessConfig):
    stream: bool = False
    """Each call as verifiers' own chat program makes it (``core.chat``: streamed, usage
    included, the stream read back into a completion). Not for training runs: that function
    ends its process (SystemExit) when the connection fails."""


class Calculator(vf.Harness[CalculatorConfig]):
    """Offer ``add``, run the calls that come back, ask again until a plain reply (at most
    three calls), all through the rollout's interception endpoint."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: vf.TaskData) -> ProgramResult:
        _, prompt = self.resolve_text_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        # (the SDK's 5 s connect timeout is short for 2 heavily shared cores; one TLS context
        # for every episode's client, as the gateway's own clients share one: building it
        # anew was a quarter of this module's learning test)
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=300.0,
                               http_client=DefaultAsyncHttpxClient(verify=tls())) as client:
            for _ in range(3):
                response = await (
                    core.chat(client, ctx.model, messages, [ADD_TOOL]) if self.config.stream
                    else client.chat.completions.create(model=ctx.model, messages=messages,
                                                        tools=[ADD_TOOL]))
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                messages += tool_results(message.tool_calls)
        return ProgramResult(exit_code=0, stdout="", stderr="")


def env_config(split: str, stream: bool = False) -> vf.SingleAgentEnvConfig:
    """The env as verifiers runs it, on its local (subprocess) runtime."""
    return vf.SingleAgentEnvConfig(
        taskset={"id": "toy_verifiers", "split": split},
        agent={"runtime": {"type": "subprocess"},
               "harness": {"id": "toy_verifiers", "stream": stream}})


program = VerifiersProgram(env_config("train"), eval=env_config("eval"))
run, tasks = program.run, program.tasks
run_streaming = VerifiersProgram(env_config("train", stream=True)).run
