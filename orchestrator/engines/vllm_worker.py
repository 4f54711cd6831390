"""The worker extension the vLLM engine installs in vLLM's workers (``worker_extension_cls``).

vLLM runs its model in worker processes; ``AsyncLLM.collective_rpc(name, args)`` calls a
method of that name on every worker. These methods load a safetensors payload through the
model runner's in-place reload (``reload_weights``: each parameter's own weight loader, so
fused and sharded layers, tensor parallelism included, are filled the way vLLM fills them
from a checkpoint). Imported only inside vLLM's worker processes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class WeightLoader:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's."""

    model_runner: Any

    def polyrl_load_bytes(self, data: bytes, partial: bool = False) -> int:
        """Load safetensors ``data``; returns the number of tensors loaded. ``partial``: some
        layers only (a LoRA update's), the others keep their weights without a warning."""
        from safetensors.torch import load

        return self._polyrl_reload(load(data), partial)

    def polyrl_load_file(self, path: str, partial: bool = False) -> int:
        """Load the safetensors file at ``path`` (on this host); returns the tensor count."""
        from safetensors.torch import load_file

        return self._polyrl_reload(load_file(path), partial)

    def polyrl_load_base(self, source: bytes | str) -> int:
        """Load a full update (safetensors bytes, or the path of a file on this host) and keep
        it, in the wire dtype, as the base the next delta is applied to (``engine.delta``:
        vLLM's own tensors are fused and sharded, not the update's, so the base is this copy).
        Returns the tensor count."""
        from safetensors.torch import load, load_file

        from orchestrator.fingerprint import fingerprint

        tensors = load(source) if isinstance(source, bytes) else load_file(source)
        self._polyrl_base = (fingerprint(tensors), tensors)
        return self._polyrl_reload(tensors, False)

    def polyrl_load_delta(self, payload: bytes, base: str, target: str) -> str:
        """Rebuild the new weights from the kept base and a pickled delta (name ->
        :class:`~orchestrator.delta.TensorDelta`) and load them, only if the base's fingerprint
        is ``base`` and the rebuilt weights' is ``target``: ``applied``; else nothing is loaded
        and the answer says why (``no_base``, ``mismatch``) so the engine sends the full update."""
        import pickle

        from orchestrator.delta import DeltaUnusable, rebuild
        from orchestrator.fingerprint import fingerprint

        kept = getattr(self, "_polyrl_base", None)
        if kept is None or kept[0] != base:
            return "no_base"
        try:
            tensors = rebuild(pickle.loads(payload), kept[1])  # the engine's own payload
        except DeltaUnusable:
            return "mismatch"
        if fingerprint(tensors) != target:
            return "mismatch"
        self._polyrl_reload(tensors, False)
        self._polyrl_base = (target, tensors)
        return "applied"

    def polyrl_fused_modules(self) -> dict[str, list[str]]:
        """The model's layers that each load several checkpoint modules, only whole
        (``packed_modules_mapping``: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``)."""
        mapping = getattr(self.model_runner.get_model(), "packed_modules_mapping", None) or {}
        return {layer: list(parts) for layer, parts in mapping.items()}

    def _polyrl_reload(self, tensors: Mapping[str, torch.Tensor], partial: bool) -> int:
        with _quiet_about_layers_not_loaded() if partial else contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=iter(list(tensors.items())))
        return len(tensors)


@contextlib.contextmanager
def _quiet_about_layers_not_loaded() -> Iterator[None]:
    """vLLM warns once per layer a reload leaves as it was, and lists their weights: a LoRA
    update leaves most layers so on purpose."""
    def loaded(record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in _NOT_LOADED)

    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
               for name in ("layerwise", "inplace")]
    for logger in loggers:
        logger.addFilter(loaded)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(loaded)


_NOT_LOADED = ("Failed to load weights", "were not loaded from checkpoint")
