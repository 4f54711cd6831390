"""Agent programs as environments: an OpenAI-compatible gateway that records every token.

* :mod:`~orchestrator.gateway.protocol` — the OpenAI wire format: requests checked into
  typed records (400 with OpenAI's error body otherwise), responses and stream chunks.
* :mod:`~orchestrator.gateway.episode` — one episode's calls as token segments, appended to
  exactly as the episode runner appends (prompt, sampled ids, continuation ids).
* :mod:`~orchestrator.gateway.server` — the aiohttp server, one key per episode.
* :mod:`~orchestrator.gateway.runner` — episodes and groups of the agent env, for the
  pipeline and the evaluation.
* :mod:`~orchestrator.gateway.serve` — an engine behind an OpenAI-compatible URL with nothing
  recorded (no episode, no key per call): a judge reward's model
  (``python -m orchestrator.serve``).

It sits above the engines and below the pipeline: the pipeline opens the gateway for an
agent env and runs its groups here; the env (:mod:`envs.agent`) gets a base URL and a key as
plain data and never imports this package.
"""

from orchestrator.gateway.runner import (
    agent_gateway,
    evaluate_agents,
    run_agent_episode,
    run_agent_group,
)
from orchestrator.gateway.server import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig", "agent_gateway", "evaluate_agents", "run_agent_episode",
           "run_agent_group"]
