"""Reward shaping and sample masks before the advantages (``algo.shaping``).

Each piece is a callable ``(trajectory, reward) -> (reward, trained, value)``: the reward to
use, whether the sample is trained at all, and what the piece logs for it (``piece.metric``,
averaged over the step's samples). Pieces apply in the order the config lists them.

* ``OverlongPenalty`` (DAPO's soft overlong punishment, arXiv 2503.14476): with ``L`` the
  generated tokens (every turn's: for a multi-turn budget set ``max_length``), ``L_max`` the
  generation cap (``max_length``, else the per-turn ``rollout.max_tokens`` the episode ran with) and ``B`` the ``buffer``, the reward gets
  ``0`` up to ``L_max - B``, then ``(L_max - B - L) / B`` (down to ``-1``) in the last ``B``
  tokens, ``-1`` beyond; scaled by ``factor``. Logged as ``shaping/overlong_penalty`` (mean).
* ``MaskTruncated``: a sample cut off by the generation cap (``finish_reason == "length"``) is
  not trained — its reward says nothing about an answer it never finished. Logged as
  ``shaping/truncated_masked`` (fraction of samples).
"""

from __future__ import annotations

from orchestrator.errors import ConfigError
from orchestrator.types import Trajectory


class OverlongPenalty:
    def __init__(self, buffer: int = 64, max_length: int | None = None, factor: float = 1.0) -> None:
        if buffer < 1:
            raise ConfigError(f"algo.shaping.overlong.buffer must be >= 1 token, got {buffer}")
        if max_length is not None and max_length <= buffer:
            raise ConfigError(f"algo.shaping.overlong.max_length ({max_length}) must exceed its "
                              f"buffer ({buffer})")
        self.buffer, self.max_length, self.factor = buffer, max_length, factor
        self.metric = "shaping/overlong_penalty"

    def penalty(self, length: int, cap: int) -> float:
        free = cap - self.buffer
        if length <= free:
            return 0.0
        return self.factor * max((free - length) / self.buffer, -1.0)

    def __call__(self, trajectory: Trajectory, reward: float) -> tuple[float, bool, float]:
        cap = self.max_length or trajectory.max_tokens
        if cap <= self.buffer:  # the cap is unknown (0) or too short to have a buffer
            return reward, True, 0.0
        p = self.penalty(trajectory.num_generated, cap)
        return reward + p, True, p


class MaskTruncated:
    def __init__(self) -> None:
        self.metric = "shaping/truncated_masked"

    def __call__(self, trajectory: Trajectory, reward: float) -> tuple[float, bool, float]:
        truncated = trajectory.finish_reason == "length"
        return reward, not truncated, float(truncated)
