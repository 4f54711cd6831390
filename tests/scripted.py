"""A scripted inference engine for tests: it replies with a function of the prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.engines.base import InferenceEngine
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.types import FinishReason, Generation, SamplingParams

TOK = CharTokenizer()


class ScriptedEngine(InferenceEngine):
    """Replies with ``reply(prompt)`` (then the first stop token), log-prob -0.5 per token."""

    def __init__(self, reply: Any, version: int = 3) -> None:
        self.reply = reply
        self.version = version
        self.prompts: list[list[int]] = []
        self.sampling: list[SamplingParams] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.sampling.append(sampling)
        ids = TOK.encode(self.reply(list(prompt_ids)))[: sampling.max_tokens - 1] + [sampling.stop_token_ids[0]]
        return Generation(tuple(ids), tuple([-0.5] * len(ids)), tuple([self.version] * len(ids)),
                          FinishReason.STOP, self.version)

    async def update_weights(self, weights: Mapping[str, Any], version: int) -> None:
        self.version = version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass
