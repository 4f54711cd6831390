"""Reward functions the tests name as ``dataset_reward_fns:<name>`` (imported by the reward
worker processes too: this directory is on the tests' path)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from envs.base import Reward


def length_bonus(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if metadata.get("difficulty") == "easy" and answer in completion else 0.0


async def async_named(completion: str, answer: str, metadata: Mapping[str, Any]) -> Reward:
    return Reward(total=0.5, components={"half": 0.5})


def picky(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """Hangs on "hang", kills its own process on "crash", raises on "raise"; else 1."""
    if "hang" in completion:
        time.sleep(3600)
    if "crash" in completion:
        os._exit(3)
    if "raise" in completion:
        raise ValueError("cannot verify this")
    return 1.0


def wrong_signature(completion: str) -> float:
    return 0.0


not_a_function = 3
