"""A user's reward the vote tests name as ``vote_reward_fns:city`` (imported by the reward
worker processes too: this directory is on the tests' path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NAMES = {"nyc": "new york city", "new york": "new york city", "the big apple": "new york city"}


def city(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """1 when the reply names the answer's city, by any of its names (``NYC`` is New York
    City); the row's ``strict`` column refuses the nicknames."""
    def canon(text: str) -> str:
        text = text.strip().strip(".").lower()
        return text if metadata.get("strict") else NAMES.get(text, text)

    return 1.0 if canon(completion) == canon(answer) else 0.0
