"""How per-token losses become the (mini)batch's loss (``algo.aggregation``).

The normalisers count the whole minibatch over every micro-batch and trainer rank
(``LossInputs.num_tokens``, ``num_sequences``), so the gradient does not depend on how the
batch is split.

* ``token_mean`` (DAPO; the default): the sum over every trained token / the trained tokens.
  Long sequences weigh more, per token as much as short ones.
* ``sequence_mean``: each sequence's mean over its tokens, averaged over the sequences (the
  original GRPO's; GSPO's). A short sequence's tokens weigh more than a long one's.
* ``sequence_sum``: each sequence's sum over its tokens / ``constant``, averaged over the
  sequences (Dr.GRPO, arXiv 2503.20783: no length bias; ``constant`` is typically the
  generation cap, and defaults to it).
"""

from __future__ import annotations

import torch

from orchestrator.algo.base import LossInputs
from orchestrator.errors import ConfigError

MODES = ("token_mean", "sequence_mean", "sequence_sum")


def check(mode: str, constant: float | None) -> None:
    if mode not in MODES:
        raise ConfigError(f"algo.aggregation must be one of {', '.join(MODES)}, got {mode!r}")
    if constant is not None and mode != "sequence_sum":
        raise ConfigError(f"algo.aggregation_constant={constant} applies to "
                          f"algo.aggregation=sequence_sum only, not {mode}: set it to null")
    if constant is not None and constant <= 0:
        raise ConfigError(f"algo.aggregation_constant must be > 0, got {constant}")


def aggregate(values: torch.Tensor, inputs: LossInputs, mode: str,
              constant: float | None = None) -> torch.Tensor:
    """This micro-batch's share of the minibatch's loss for per-token ``values``."""
    masked = values * inputs.mask
    if mode == "token_mean":
        return masked.sum() / max(inputs.num_tokens, 1.0)
    if mode == "sequence_mean":
        return inputs.sequence_mean(values).sum() / inputs.total_sequences
    if mode == "sequence_sum":
        scale = constant if constant is not None else float(inputs.mask.shape[1])
        return masked.sum() / (inputs.total_sequences * scale)
    raise ConfigError(f"algo.aggregation must be one of {', '.join(MODES)}, got {mode!r}")
