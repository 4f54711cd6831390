"""The trainer's precision policy (``trainer.precision``): what its weights and optimiser state
are kept in, and what its forward and backward passes compute in.

* ``fp32``: float32 weights, optimiser state and compute.
* ``mixed``: float32 master weights and optimiser state, the forward pass under bf16 autocast
  (matrix products in bf16, reductions and the loss in float32); gradients land in float32.
  Under trainer ranks the same policy is FSDP2's ``MixedPrecisionPolicy`` (parameters gathered
  in bf16, gradients reduced in float32) instead of autocast.
* ``bf16``: bf16 weights, optimiser state and compute (half the memory; each update is
  rounded to bf16, so small learning rates lose most of their steps).
* ``auto`` (the default) follows the engine's weights (``model.dtype``, which both sides
  load): a float32 model trains in ``fp32``; a bf16 or fp16 one ``mixed`` on a GPU that
  computes in bf16 (else ``fp32``), and as loaded on the CPU (as before this option existed).
  Measured (docs/gpu.md): a float32 engine against a ``mixed`` trainer disagrees by 0.03 on
  average where ``fp32`` on both sides agrees to 5e-6, and SmolLM2's steps on an H100 took
  0.20 s under ``mixed`` against 0.08 s in ``fp32`` (a small model is bound by kernel
  launches, which autocast's casts add to), so ``mixed`` is the choice for bf16 weights,
  not a default for every model.

The LM head is separate (``model.fp32_head``, :class:`~orchestrator.models.policy.Fp32Head`):
it applies to the engine and the trainer together, since an fp32 head on one side only widens
their disagreement. docs/gpu.md has the measured log-prob agreement of each combination.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.errors import ConfigError

PRECISIONS = ("auto", "fp32", "mixed", "bf16")


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 (every CPU torch runs it; GPUs from Ampere on)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | mixed | bf16, or the model's own dtype's name (auto on the CPU)
    weights: torch.dtype  # the master weights and the optimiser state
    compute: torch.dtype | None  # autocast's dtype (None: the weights' own)

    @classmethod
    def resolve(cls, name: str, device: torch.device, model_dtype: torch.dtype) -> Precision:
        if name not in PRECISIONS:
            raise ConfigError(f"trainer.precision={name} must be one of {', '.join(PRECISIONS)}")
        if name == "auto":
            if model_dtype == torch.float32:
                name = "fp32"
            elif device.type != "cuda":
                return cls(str(model_dtype).removeprefix("torch."), model_dtype, None)
            else:
                name = "mixed" if bf16_supported(device) else "fp32"
        if name in ("mixed", "bf16") and not bf16_supported(device):
            raise ConfigError(f"trainer.precision={name} needs bf16, which this GPU "
                              f"({torch.cuda.get_device_name(device)}) does not compute; use "
                              f"trainer.precision=fp32")
        if name == "fp32":
            return cls(name, torch.float32, None)
        if name == "mixed":
            return cls(name, torch.float32, torch.bfloat16)
        return cls(name, torch.bfloat16, None)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Around a forward pass: bf16 autocast under ``mixed``, else nothing."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)
