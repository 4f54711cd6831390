"""Token ids of replayed messages: the right lengths, no text.

The replay environment (:mod:`envs.replay`) writes placeholder text of one character per
token and names an episode's plan in its opening message's own field. :class:`ReplayTokenizer`
reads one token per character and lays out the ids the replay engine reads back:

* a prompt's first token is ``KEY_BASE + key`` of its plan (the engine looks the turn's
  counts up by it);
* an observation turn starts with one ``OBS`` marker (the engine counts turns by them);
* every other token is ``FILL``; generation stops at ``STOP``.

Decoding gives ``<n tokens>``: nothing reads the text of a replay.
"""

from __future__ import annotations

from collections.abc import Sequence

from envs.base import Message
from envs.replay import plan_of
from orchestrator.models.tokenizer import Tokenizer

PAD, STOP, OBS, FILL = 0, 1, 2, 3
KEY_BASE = 16  # the opening token of plan ``key`` is KEY_BASE + key


class ReplayTokenizer(Tokenizer):
    pad_id = PAD
    vocab_size = 1 << 30

    def encode(self, text: str) -> list[int]:
        return [FILL] * len(text)

    def decode(self, ids: Sequence[int]) -> str:
        return f"<{len(ids)} tokens>"

    def chat_prompt(self, messages: Sequence[Message], continuation: bool = False,
                    tools: object = None) -> list[int]:
        ids: list[int] = []
        for m in messages:
            tokens = self.encode(m.get("content", ""))
            key = plan_of(m)
            if key is not None:  # the opening message: its first token names the plan
                tokens[:1] = [KEY_BASE + key]
            ids += tokens
        if continuation and ids:
            ids[0] = OBS
        return ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (STOP,)


def plan_key(prompt_ids: Sequence[int]) -> int | None:
    """The plan a prompt of :class:`ReplayTokenizer` belongs to (None: not a replay prompt)."""
    return prompt_ids[0] - KEY_BASE if prompt_ids and prompt_ids[0] >= KEY_BASE else None


def turn_of(prompt_ids: Sequence[int]) -> int:
    """Which turn of its plan a prompt asks for: the observations it holds."""
    return prompt_ids.count(OBS)
