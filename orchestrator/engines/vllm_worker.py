"""The worker extension the vLLM engine installs in vLLM's workers (``worker_extension_cls``).

vLLM runs its model in worker processes; ``AsyncLLM.collective_rpc(name, args)`` calls a
method of that name on every worker. These methods load a safetensors payload through the
model runner's in-place reload (``reload_weights``: each parameter's own weight loader, so
fused and sharded layers, tensor parallelism included, are filled the way vLLM fills them
from a checkpoint), and fingerprint the weights the worker holds (``engine.attest``;
docs/attestation.md "vLLM"). Imported only inside vLLM's worker processes.

Attestation reads the trainer's tensors back from the layout vLLM holds them in: a fused layer
(``qkv_proj``, ``gate_up_proj``: ``packed_modules_mapping``) is its parts concatenated along the
output dimension, in the sizes of its ``output_sizes``; an embedding has padding rows past its
``org_vocab_size``; a tied LM head is the embedding. On vLLM's CPU build a linear layer's weight
is handed to a GEMM kernel after every load and the parameter emptied, so
:meth:`WeightLoader.polyrl_keep_weights` first marks every linear layer to keep it (vLLM's
``_cpu_skip_gemm_dispatch``: ``torch.nn.functional.linear`` on the weight itself) and reloads the
weights, so that what is fingerprinted is what the layers compute with. One worker only
(``tensor_parallel_size=1``): a shard is not a trainer tensor.
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

        from orchestrator.weights.fingerprint import fingerprint

        tensors = load(source) if isinstance(source, bytes) else load_file(source)
        self._polyrl_base = (fingerprint(tensors), tensors)
        return self._polyrl_reload(tensors, False)

    def polyrl_load_delta(self, payload: bytes, base: str, target: str) -> str:
        """Rebuild the new weights from the kept base and a pickled delta (name ->
        :class:`~orchestrator.weights.delta.TensorDelta`) and load them, only if the base's
        fingerprint is ``base`` and the rebuilt weights' is ``target``: ``applied``; else nothing is
        loaded and the answer says why (``no_base``, ``mismatch``) so the engine sends the full
        update."""
        import pickle

        from orchestrator.weights.delta import DeltaUnusable, rebuild
        from orchestrator.weights.fingerprint import fingerprint

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

    def polyrl_keep_weights(self) -> int:
        """Have every linear layer keep its weight as a tensor and compute with it (on the CPU
        build; elsewhere the weights stay tensors anyway), then reload the weights from the
        model's directory so the layers emptied at start hold them again. Returns the count of
        layers marked."""
        from vllm.model_executor.layers.linear import LinearBase

        marked = 0
        for module in self.model_runner.get_model().modules():
            if isinstance(module, LinearBase):
                module._cpu_skip_gemm_dispatch = True
                weight = getattr(module, "weight", None)
                if weight is not None and weight.numel() == 0:
                    # emptied by the CPU kernel: a full-size tensor for the reload to fill
                    shape = (sum(getattr(module, "output_partition_sizes", None)
                                 or [module.output_size_per_partition]),
                             module.input_size_per_partition)
                    module.weight = torch.nn.Parameter(
                        torch.empty(shape, dtype=weight.dtype, device=weight.device),
                        requires_grad=False)
                marked += 1
        self.model_runner.reload_weights()
        return marked

    def polyrl_fingerprint(self, names: list[str]) -> str:
        """The fingerprint (orchestrator/weights/fingerprint.py) of the tensors this worker holds,
        under the trainer's ``names``."""
        from orchestrator.weights.fingerprint import fingerprint

        held = _trainer_view(self.model_runner.get_model())
        if "lm_head.weight" in names and "lm_head.weight" not in held:  # tied to the embedding
            held["lm_head.weight"] = held["model.embed_tokens.weight"]
        missing = [n for n in names if n not in held]
        if missing:
            raise KeyError(f"vLLM holds no tensor for {missing[0]} (of {len(missing)})")
        return fingerprint({n: held[n] for n in names})

    def _polyrl_reload(self, tensors: Mapping[str, torch.Tensor], partial: bool) -> int:
        with _quiet_about_layers_not_loaded() if partial else contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=iter(list(tensors.items())))
        return len(tensors)


def _trainer_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint's names: fused layers split into their
    parts, embeddings without their padding rows (views, no copies)."""
    fused = getattr(model, "packed_modules_mapping", None) or {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        layer = module_name.rpartition(".")[2]
        if layer in fused and hasattr(module, "output_sizes"):
            start = 0
            for part, size in zip(fused[layer], module.output_sizes, strict=True):
                out[f"{module_name.rpartition('.')[0]}.{part}.{leaf}"] = tensor[start:start + size]
                start += size
        elif hasattr(module, "org_vocab_size"):
            out[name] = tensor[:module.org_vocab_size]
        else:
            out[name] = tensor
    return out


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
