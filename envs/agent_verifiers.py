"""A verifiers (0.4) environment as an agent program, for ``env=agent``.

A verifiers environment (``verifiers.v1``: a taskset, its tasks' ``@vf.reward`` rubric, a
seat played by a harness) is trained unchanged. ``my_vf.py``::

    import verifiers.v1 as vf
    from envs.agent_verifiers import VerifiersProgram

    def config(split):  # the env as verifiers would run it; a local runtime
        return vf.SingleAgentEnvConfig(taskset={"id": "my-taskset", "split": split},
                                       agent={"runtime": {"type": "subprocess"}})

    program = VerifiersProgram(config("train"), eval=config("eval"))
    run, tasks = program.run, program.tasks

and ``env=agent env.program=my_vf:run``. Each episode runs verifiers' own
:meth:`verifiers.v1.Env.run_episode` on its task: the env's serving resources (its
interception server, on 127.0.0.1) are opened for the episode, and its
:class:`~verifiers.v1.ModelContext` client is the episode's gateway, so every model call of
the harness goes harness -> interception server -> gateway, where it is recorded. Verifiers
scores the traces (the task's rewards and judges); the episode's reward is the mean over the
trainable traces, with the named rewards as components. A verifiers episode that failed
(``episode.ok`` false) raises, so it is a failed episode here: reward 0, ``agent/errors``.

Two things are per episode on purpose. The env is built from its config each episode: a
verifiers ``Env`` holds its serving resources on the instance, so concurrent episodes cannot
share one. The key: verifiers reads an endpoint's API key from an environment variable
(``api_key_var``), so each episode sets one of its own (its name has ``API_KEY`` in it, which
verifiers' subprocess runtime keeps out of the programs it starts) while it runs.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from envs.base import Reward, Task
from envs.errors import EnvConfigError

try:
    import verifiers.v1 as vf
except ImportError as e:  # the agents extra
    raise EnvConfigError("envs.agent_verifiers runs verifiers environments: pip install -e "
                         "'.[agents]'") from e

KEY = "verifiers_key"  # a task's metadata: the verifiers task it stands for


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not complete (its own errors, in its message)."""


class VerifiersProgram:
    """``run(task, client)`` and ``tasks(split)`` over verifiers env configs, one per split
    (``eval`` None: no evaluation tasks). ``model`` is the name the harness's calls carry."""

    def __init__(self, train: vf.EnvConfig, eval: vf.EnvConfig | None = None,
                 model: str = "policy") -> None:
        self.configs = {"train": train, "eval": eval}
        self.model = model
        self._tasks: dict[str, tuple[vf.Task, vf.EnvConfig]] = {}

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The split's verifiers tasks as env=agent tasks (prompt, answer if the data has
        one, the verifiers task's key in the metadata)."""
        config = self.configs.get(split)
        if config is None:
            return []
        items = []
        for task in vf.load_taskset(config.taskset):
            self._tasks[task.key] = (task, config)
            prompt = task.data.prompt
            items.append({"id": task.data.idx, KEY: task.key,
                          "answer": str(getattr(task.data, "answer", "")),
                          **({"prompt": prompt} if isinstance(prompt, str | None) else
                             {"messages": [m.model_dump(exclude_none=True) for m in prompt]})})
        return items

    async def run(self, task: Task, client: Any) -> Reward:
        """One verifiers episode of ``task`` against ``client``'s base URL and key."""
        key = task.metadata[KEY]
        if key not in self._tasks:  # a process that did not list them (env.processes > 0)
            for split in self.configs:
                self.tasks(split)
        vf_task, config = self._tasks[key]
        key_var = f"POLYRL_EPISODE_API_KEY_{secrets.token_hex(8)}"
        os.environ[key_var] = client.api_key
        try:
            ctx = vf.ModelContext(model=self.model, client=vf.EvalClientConfig(
                base_url=str(client.base_url), api_key_var=key_var))
            env = vf.load_environment(config)
            async with env.serving():
                episode = await env.run_episode(vf_task, ctx)
        finally:
            del os.environ[key_var]
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            raise VerifiersEpisodeError("; ".join(f"{e.type}: {e.message}" for e in errors)
                                        or "the verifiers episode did not complete")
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        return Reward(sum(t.reward for t in traces) / max(len(traces), 1),
                      _components(traces))


def _components(traces: list[Any]) -> dict[str, float]:
    """Each named reward's score, averaged over the traces that have it."""
    scores: dict[str, list[float]] = {}
    for trace in traces:
        rewards: Mapping[str, Any] = trace.rewards
        for name, reward in rewards.items():
            if reward is not None:
                scores.setdefault(name, []).append(float(reward.score))
    return {name: sum(values) / len(values) for name, values in scores.items()}
