"""Reward functions ``bench.dataset`` names in ``env.reward`` (``bench.dataset_rewards:…``): kept
apart from the benchmark so a verification worker imports only this."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any


def hang_one_in_50(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """0, except that one call in 50 (at random: the tiny model repeats its replies, so a rule
    on the text would hang on one distinct reply in 50, far more calls) never returns."""
    if random.random() < 1 / 50:
        while True:
            time.sleep(3600)
    return 0.0


def zero(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """0, at once: what isolating a user's function costs, without any hang."""
    return 0.0
