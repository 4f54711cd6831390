"""vLLM behind the ``InferenceEngine`` interface (``engine=vllm``; the ``vllm`` extra).

vLLM's asynchronous engine (``AsyncLLM``) runs in this process's event loop, or in a Ray
actor's through ``launcher=ray``; its scheduler and model run in vLLM's own worker
processes. What it does for the pipeline:

* **Token in, token out.** Prompts go in as token ids and tokens come back as ids: vLLM's
  tokenizer is never loaded (``skip_tokenizer_init``), so nothing is re-tokenised. Each
  token's behaviour log-probability is taken after temperature scaling and the ``top_k`` /
  ``top_p`` truncation (``logprobs_mode="processed_logprobs"``), the distribution it was
  sampled from (renormalised over the tokens the truncation kept).
* **Versions.** Every weight load labels vLLM's weights with the policy version
  (``update_weight_version``); vLLM reports, per request, which output tokens each label
  produced, so each token carries the version that produced it, across updates mid-request.
* **Pause and resume at a token boundary, keeping requests.** :meth:`pause` is
  ``pause_generation(mode="keep", clear_cache=True)``: requests in flight are frozen, not
  aborted, and their KV cache and the prefix cache are dropped, so after :meth:`resume`
  they are recomputed (prompt plus the tokens so far) under the new weights and no cached
  prefix from the old weights is reused. Both ``pipeline.inflight_update`` modes work on it.
* **Weight updates**, ``engine.weight_transfer`` (:mod:`orchestrator.engines.placement`
  chooses for ``auto``). ``rpc``, the route on CPU and for a trainer in another process: a
  worker extension (:mod:`orchestrator.engines.vllm_worker`) called with ``collective_rpc``
  reloads the weights in place through the model's own weight loaders; a file update is read
  by the workers from its path, any other transport travels as safetensors bytes. ``ipc``
  (the trainer on the engine's GPU) and ``nccl`` (the trainer on a GPU of its own), with the
  trainer in this process: vLLM's own weight-transfer engines (``WeightTransferConfig``,
  driven by :mod:`orchestrator.engines.vllm_transfer`), which load through the same layerwise
  reload, into the parameters' own storage, so CUDA graphs stay valid.
* **Attestation** (``engine.attest=true``; docs/attestation.md): after every load the workers
  fingerprint the weights they hold, read back under the trainer's names
  (:mod:`orchestrator.engines.vllm_worker`), and each generation carries the fingerprint of
  each version its tokens came from. On the CPU build the linear layers then keep their
  weights as tensors (torch's linear, not oneDNN: slower decoding). One worker, full weights.
* **Colocation** (``launcher.colocate=true``, one GPU for the trainer and the engine): vLLM
  runs with sleep mode; :meth:`sleep` (before each train step) is vLLM's ``sleep(level=1)``
  (weights offloaded to CPU, KV cache dropped, requests in flight kept), the next update
  wakes the weights (``wake_up(tags=["weights"])``), loads the new ones and labels them, and
  :meth:`resume` wakes the KV cache (``wake_up(tags=["kv_cache"])``), which lets vLLM's
  scheduler go on. ``engine.gpu_memory_utilization=auto`` then leaves the trainer what it
  keeps resident while the engine generates (:func:`~orchestrator.engines.placement.
  engine_memory_share`), as it does for a trainer on the engine's GPU without colocation;
  alone on its GPU, auto is 0.9.
* **LoRA updates** (``trainer.lora``) are merged here, ``W0 + scale * B @ A`` from the base
  weights the first update carried (:class:`~orchestrator.weights.update.AdapterMerger`), and only
  the layers they touch are reloaded, each whole: vLLM fuses ``q_proj``, ``k_proj`` and
  ``v_proj`` into one ``qkv_proj`` (``gate_proj`` and ``up_proj`` into ``gate_up_proj``) and
  reloads a fused layer only from all its parts, so the parts an adapter leaves alone (and
  biases) are sent from the kept base too. Merged rather than vLLM's own LoRA
  (``enable_lora``): on vLLM's CPU build it decodes at less than half the speed
  (``bench/vllm_lora.py``; docs/scaling.md).

KV cache size: on CPU, ``engine.kv_cache_bytes`` (default 1 GiB; ``4GiB`` and plain byte
counts are accepted). vLLM's CPU build would otherwise size it as ``gpu_memory_utilization``
times the memory of NUMA node 0 minus what is in use there, which depends on the machine's
NUMA layout and page cache (node 0 may be a fraction of the machine). On a GPU,
``gpu_memory_utilization`` applies unless ``kv_cache_bytes`` is given.

The nccl and ipc routes and sleep mode have not yet run on a GPU (docs/vllm.md).

The model is the run's ``conf/model`` node: a Hugging Face directory (``model=hf``, or a GGUF
converted into one, ``model=smollm2``) is served from its path; a model built from config (``model=tiny``) is written once to a
temporary directory with the starting weights. vLLM's CPU build needs a head size of at
least 32 (64 is safest); the tiny default (128 / 4 heads) qualifies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Self

import anyio
import torch

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.placement import (
    Placement,
    WeightTransfer,
    check_colocation,
    choose_weight_transfer,
    engine_memory_share,
)
from orchestrator.errors import ConfigError, EngineClosed
from orchestrator.models.policy import build_policy, checkpoint_dir
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights.delta import DeltaEncoder, LoadCounter, Loaded
from orchestrator.weights.update import AdapterMerger, WeightUpdate

log = logging.getLogger(__name__)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Updates above this go to the workers through a file, not as bytes in a collective_rpc: vLLM's
# msgpack channel to its engine core holds at most 4 GiB in one value.
RPC_BYTES_MAX = 1 << 30
SHM = Path("/dev/shm")
CPU_KV_CACHE_BYTES = 1 << 30  # kv_cache_bytes=auto on CPU
KEEP_VERSIONS = 64  # fingerprints kept for requests still running across updates
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6,
          "GB": 10**9}


def parse_bytes(value: int | str | None, key: str = "engine.kv_cache_bytes") -> int | None:
    """``1073741824``, ``"512MiB"``, ``"1GiB"`` → bytes; ``None`` / ``"auto"`` → None."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMG]I?B|B)?", str(value).strip().upper())
    if isinstance(value, bool) or match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"{key}={value} must be a positive size such as 1GiB, 512MiB or a "
                          "byte count, or auto")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def _check_options(gpu_memory_utilization: float | str, max_num_seqs: int,
                   max_model_len: int | None, tensor_parallel_size: int, dtype: str) -> None:
    if gpu_memory_utilization != "auto" and not (
            isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
        raise ConfigError(
            f"engine.gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1] or auto "
            "(on CPU: the share of memory for the KV cache; about 0.3 or less on a small "
            "machine)")
    if max_num_seqs < 1:
        raise ConfigError(f"engine.max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 2:
        raise ConfigError(f"engine.max_model_len must be >= 2 or null (the model's), got {max_model_len}")
    if tensor_parallel_size < 1:
        raise ConfigError(f"engine.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if dtype not in DTYPES:
        raise ConfigError(f"engine.dtype={dtype} is not one of {', '.join(DTYPES)}")


class VLLMEngine(InferenceEngine):
    def __init__(
        self,
        model: Mapping[str, Any],
        weights: WeightUpdate | None = None,
        gpu_memory_utilization: float | Literal["auto"] = "auto",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        kv_cache_bytes: int | str | None = "auto",
        delta: bool = False,  # engine.delta: updates to the workers as deltas (rpc route)
        weight_transfer: WeightTransfer = "auto",
        placement: Placement | None = None,
        attest: bool = False,  # fingerprint the weights the workers hold after every load
    ) -> None:
        _check_options(gpu_memory_utilization, max_num_seqs, max_model_len, tensor_parallel_size,
                       dtype)
        if attest and tensor_parallel_size > 1:
            raise ConfigError("engine.attest=true reads the trainer's tensors back from one "
                              "worker's weights, and engine.tensor_parallel_size="
                              f"{tensor_parallel_size} shards them: set engine.attest=false")
        if attest and weights is not None and weights.adapters is not None:
            raise ConfigError("engine=vllm merges LoRA adapters into its weights, so it cannot "
                              "fingerprint the adapters the trainer publishes: set "
                              "engine.attest=false with trainer.lora")
        self._attest = attest
        self._attested: dict[int, str] = {}  # version -> fingerprint of the weights held
        self._names: list[str] = []  # the trainer's tensor names the fingerprint covers
        if model.get("fp32_head"):  # the trainer's head alone in float32 widens the gap
            raise ConfigError("model.fp32_head=true is for engine=torch: vLLM computes its LM head "
                              "in the model's dtype, so only the trainer's would be float32; "
                              "set model.fp32_head=false with engine=vllm")
        kv_bytes = parse_bytes(kv_cache_bytes)
        cuda = torch.cuda.is_available()
        # the launcher told the trainer's side; the engine's side is this process's view
        self.placement = replace(placement or Placement(), cuda=cuda,
                                 engine_gpus=tuple(range(tensor_parallel_size)) if cuda else ())
        check_colocation(self.placement)
        self.transfer = choose_weight_transfer(weight_transfer, self.placement)
        try:
            import vllm  # noqa: F401 - fail here, with the fix, rather than at the first request
        except ImportError as e:
            raise ConfigError(
                "engine=vllm needs vLLM: pip install -e '.[vllm]' on a GPU machine, or "
                "bash scripts/setup_vllm.sh for the CPU build in .venv-vllm") from e
        self._model = dict(model)
        self._served = checkpoint_dir(self._model)  # None: built from config, written at start
        self._weights = weights
        # LoRA updates: merged into the weights they adapt (made again, knowing the model's
        # fused layers, once vLLM has built it)
        self._adapters = AdapterMerger()
        self._encoder = DeltaEncoder() if delta else None
        self.loads = LoadCounter()
        if gpu_memory_utilization == "auto":
            gpu_memory_utilization = self._memory_share(weights)
        self._options: dict[str, Any] = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": self._model.get("dtype", "auto") if dtype == "auto" else dtype,
            "enable_prefix_caching": enable_prefix_caching,
            "enforce_eager": enforce_eager,
            "seed": seed,
        }
        if tensor_parallel_size > 1:
            # vLLM's own worker processes on this machine's GPUs. Its default inside a Ray
            # actor of a placement group (launcher=ray) is its Ray executor, which places the
            # workers in that group's bundles, sized for the actor alone.
            self._options["distributed_executor_backend"] = "mp"
        if self.transfer != "rpc":
            from vllm.config import WeightTransferConfig

            self._options["weight_transfer_config"] = WeightTransferConfig(backend=self.transfer)
        if self.placement.colocate:
            self._options["enable_sleep_mode"] = True
        if not cuda:  # CPU: always in bytes (see the module docstring)
            kv_bytes = kv_bytes or CPU_KV_CACHE_BYTES
            _check_cpu_room(kv_bytes)
        if kv_bytes is not None:
            self._options["kv_cache_memory_bytes"] = kv_bytes
        self.version = weights.version if weights is not None else 0
        self.max_model_len = 0  # known once started
        self._llm: Any = None
        self._workdir: Path | None = None
        self._paused = False
        self._asleep: set[str] = set()  # colocated: what vLLM's sleep put away (weights, kv_cache)
        # colocated: a sleep waits for a weight sync in progress (pause to resume) to end
        self._turn = anyio.Semaphore(1)
        self._syncing = False  # this engine's weight sync holds the turn
        self._sender: Any = None  # the trainer side of nccl / ipc (vllm_transfer.Sender)
        self._closed = False

    def _memory_share(self, weights: WeightUpdate | None) -> float:
        total = parameters = 0  # what a trainer beside the engine keeps: none here
        if self.placement.trainer_beside:
            if weights is None:
                raise ConfigError("engine.gpu_memory_utilization=auto beside a trainer on the "
                                  "engine's GPU needs the starting weights to size it: set it "
                                  "to a share")
            parameters = sum(t.numel() for t in weights.tensors().values())
            total = torch.cuda.get_device_properties(self.placement.engine_gpus[0]).total_memory
        return engine_memory_share(self.placement, total, parameters)

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError("engine=vllm runs on asyncio; this run's event loop is not asyncio") from None
        try:
            if self._attest:
                self._names = await anyio.to_thread.run_sync(self._trainer_names)
            self._llm = await anyio.to_thread.run_sync(self._start)
            self.max_model_len = int(self._llm.model_config.max_model_len)
            await self._llm.update_weight_version(str(self.version))
            if self._attest:  # the layers keep their weights as tensors (vllm_worker)
                await self._llm.collective_rpc("polyrl_keep_weights")
            fused = (await self._llm.collective_rpc("polyrl_fused_modules"))[0]
            self._adapters = AdapterMerger(fused)
            if self.transfer != "rpc":
                await self._start_sender()
            if self._weights is not None and self._served is not None:
                # A checkpoint directory was served as it is on disk; the run may start
                # elsewhere (a warm start, a resume): load the weights it was given.
                await self._load(self._weights)
            elif self._weights is not None and self._weights.adapters is not None:
                # Started from them: keep the base weights the next adapter update needs.
                await anyio.to_thread.run_sync(self._adapters.merged, self._weights)
            await self._fingerprint()
        except BaseException:
            await self.aclose()
            raise
        self._weights = None
        return self

    def _trainer_names(self) -> list[str]:
        """The names of the tensors the trainer publishes (its model's state dict)."""
        if self._weights is not None:
            return sorted(self._weights.tensors())
        return sorted(build_policy({**self._model, "device": "cpu"}).model.state_dict())

    async def _fingerprint(self) -> None:
        """The attestation, computed by the worker from the tensors it holds."""
        if self._attest:
            [self.fingerprint] = await self._llm.collective_rpc("polyrl_fingerprint",
                                                                args=(self._names,))
            self._attested[self.version] = self.fingerprint
            for old in [v for v in self._attested if v < self.version - KEEP_VERSIONS]:
                del self._attested[old]

    @property
    def attests(self) -> bool:
        return self._attest

    def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.transfer == "ipc":
            # vLLM's workers unpickle the CUDA IPC handles only with this set (vllm_transfer)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        args = AsyncEngineArgs(
            model=self._model_dir(),
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="orchestrator.engines.vllm_worker.WeightLoader",
            **self._options,
        )
        return AsyncLLM.from_engine_args(args)

    def _model_dir(self) -> str:
        """A directory vLLM can load: the checkpoint's own, or one written from config."""
        if self._served is not None:
            return str(self._served)
        policy = build_policy({**self._model, "device": "cpu"})
        self._workdir = Path(tempfile.mkdtemp(prefix="polyrl-vllm-"))
        state = AdapterMerger().merged(self._weights) if self._weights is not None else None
        policy.model.save_pretrained(self._workdir, state_dict=state)
        if self._weights is not None:
            self._weights.release()
        return str(self._workdir)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            self._sender.close()
        if self._llm is not None:
            self._llm.shutdown()
            _close_zmq(self._llm)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    # -- InferenceEngine -------------------------------------------------------------

    @property
    def context_length(self) -> int | None:
        return self.max_model_len or None  # known once started

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if self._llm is None or self._closed:
            raise EngineClosed("the vLLM engine is not running; use it as `async with engine:`")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        start_version = self.version
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        if budget <= 0:
            return Generation((), (), (), FinishReason.LENGTH, start_version)
        final = None
        async for output in self._llm.generate(
            {"prompt_token_ids": list(prompt_ids)}, self._vllm_sampling(sampling, budget),
            request_id=uuid.uuid4().hex,
        ):
            final = output
        if final is None or not final.finished:
            raise EngineClosed("the vLLM engine stopped before the request finished")
        completion = final.outputs[0]
        if completion.finish_reason not in _FINISH:
            raise EngineClosed(f"vLLM ended the request: {completion.finish_reason}")
        tokens = tuple(completion.token_ids)
        versions = _versions(completion.weight_versions, len(tokens))
        logprobs = tuple(float(step[t].logprob) for step, t in zip(completion.logprobs, tokens,
                                                                      strict=True))
        return Generation(
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            finish_reason=_FINISH[completion.finish_reason],
            start_version=start_version,
            cached_tokens=final.num_cached_tokens or 0,  # the prefix cache's hits: PolyTrace's
            fingerprints=tuple((v, self._attested[v]) for v in sorted(set(versions))
                               if v in self._attested),
        )

    def _vllm_sampling(self, sampling: SamplingParams, budget: int) -> Any:
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        return VLLMSampling(
            max_tokens=budget,
            temperature=max(sampling.temperature, 0.0),
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,  # vLLM's "all" is -1 (or 0)
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=True,  # the environment's stop tokens are the only ones
            seed=sampling.seed,
            logprobs=0,  # the sampled token's
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def update_weights(self, update: WeightUpdate) -> None:
        if not self._paused:
            raise RuntimeError("update_weights must be called between pause() and resume()")
        await self._load(update)

    async def _load(self, update: WeightUpdate) -> None:
        partial = update.adapters is not None
        if partial:  # LoRA: the adapted weights (their whole layers), merged here, are loaded
            merged = await anyio.to_thread.run_sync(self._adapters.merged, update)
            update = WeightUpdate.by_reference(update.version, merged, leased=False)
        else:
            self._adapters.forget()
        await self._wake("weights")  # colocated: the weights back first, the KV cache at resume()
        if self._encoder is not None and self._sender is None and not partial:
            await self._load_by_delta(update)
        elif self._sender is not None:
            await anyio.to_thread.run_sync(self._sender.send, update.tensors())
        elif update.path is not None:
            await self._llm.collective_rpc("polyrl_load_file", args=(str(update.path), partial))
        elif update.nbytes > RPC_BYTES_MAX:
            await self._load_through_file(update, partial)
        else:
            data = await anyio.to_thread.run_sync(update.to_bytes)
            await self._llm.collective_rpc("polyrl_load_bytes", args=(data, partial))
        await self._llm.update_weight_version(str(update.version))
        self.version = update.version
        await self._fingerprint()

    async def _load_by_delta(self, update: WeightUpdate) -> None:
        """``engine.delta`` on the rpc route: the update as a delta from the last one sent
        (:mod:`orchestrator.weights.delta`), which each worker applies to the copy it kept and loads
        only if the result's fingerprint is the published one; else (no delta, a worker without
        that base, a mismatch) the full update, which the workers keep as the next base. LoRA
        updates and vLLM's GPU weight-transfer engines are not sent as deltas."""
        assert self._encoder is not None
        served = update.served_tensors()  # the wire dtype: what the workers hold
        delta = await anyio.to_thread.run_sync(self._encoder.encode, update.version, served,
                                               update.fingerprint)
        payload, fallback = b"", False
        if delta is not None:
            payload = await anyio.to_thread.run_sync(pickle.dumps, dict(delta.tensors()))
            answers = await self._llm.collective_rpc(
                "polyrl_load_delta", args=(payload, delta.base_fingerprint, delta.fingerprint))
            if all(a == "applied" for a in answers):
                self._count(update, Loaded(len(payload), delta.full_nbytes, delta=True))
                return
            fallback = "mismatch" in answers
            if fallback:
                log.warning("weight delta to version %d failed its fingerprint check on a vLLM "
                            "worker; loading the full update", update.version)
        room = update.nbytes <= RPC_BYTES_MAX
        data = await anyio.to_thread.run_sync(update.to_bytes) if room else None
        if data is not None:
            await self._llm.collective_rpc("polyrl_load_base", args=(data,))
        else:
            path = Path(tempfile.gettempdir()) / f"polyrl-{uuid.uuid4().hex}.safetensors"
            try:
                await anyio.to_thread.run_sync(update.to_file, path)
                await self._llm.collective_rpc("polyrl_load_base", args=(str(path),))
            finally:
                path.unlink(missing_ok=True)
        full = len(data) if data is not None else update.nbytes
        self._count(update, Loaded(full + len(payload), full, fallback=fallback))

    def _count(self, update: WeightUpdate, loaded: Loaded) -> None:
        self.last_load = loaded
        self.loads.add(loaded, offered=True)

    def metrics(self) -> dict[str, float]:
        return self.loads.metrics()

    async def _load_through_file(self, update: WeightUpdate, partial: bool) -> None:
        """``update`` written to a safetensors file on this host, the workers load it, and it
        goes: vLLM carries a call's arguments to its engine core through msgpack, which holds
        at most 4 GiB in one value (about 2 B parameters in bf16). In shared memory when it has
        room (a container's /dev/shm is often 64 MiB), else the temporary directory."""
        room = _room(SHM, update.nbytes)
        path = (SHM if room else Path(tempfile.gettempdir())) / f"polyrl-{uuid.uuid4().hex}.safetensors"
        try:
            await anyio.to_thread.run_sync(update.to_file, path)
            await self._llm.collective_rpc("polyrl_load_file", args=(str(path), partial))
        finally:
            path.unlink(missing_ok=True)

    async def _start_sender(self) -> None:
        from orchestrator.engines.vllm_transfer import Sender

        assert self.placement.trainer_gpu is not None  # choose_weight_transfer() saw to it
        loop = asyncio.get_running_loop()
        self._sender = await anyio.to_thread.run_sync(
            Sender, self.transfer, self._llm, loop, torch.device("cuda", self.placement.trainer_gpu),
            len(self.placement.engine_gpus))

    async def pause(self) -> None:
        if self.placement.colocate and not self._syncing:
            await self._turn.acquire()  # released by resume()
            self._syncing = True
        if not self._paused:
            await self._llm.pause_generation(mode="keep", clear_cache=True)
            self._paused = True

    async def resume(self) -> None:
        try:
            if self._asleep:
                # vLLM resumes its scheduler once all its memory is back, the KV cache last
                await self._wake("weights")
                await self._wake("kv_cache")
            elif self._paused:
                await self._llm.resume_generation()
            self._paused = False
        finally:
            if self._syncing:
                self._syncing = False
                self._turn.release()

    async def sleep(self) -> None:
        """Colocated: free the GPU for a train step (vLLM's level-1 sleep: weights to CPU,
        KV and prefix caches dropped, requests in flight kept and recomputed after
        :meth:`resume`). Not colocated: nothing."""
        if not self.placement.colocate:
            return
        async with self._turn:
            if not self._asleep:
                await self._llm.sleep(level=1, mode="keep")
                self._asleep = {"weights", "kv_cache"}
                self._paused = True  # the weight sync's pause has nothing more to do

    async def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            _free_cached_memory(self.placement)
            await self._llm.wake_up(tags=[tag])
            self._asleep.discard(tag)


def _room(directory: Path, nbytes: int) -> bool:
    """Whether ``directory`` exists with room for ``nbytes`` and a tenth more."""
    try:
        return shutil.disk_usage(directory).free > 1.1 * nbytes
    except OSError:
        return False


def _free_cached_memory(placement: Placement) -> None:
    """A colocated trainer in this process holds the blocks its step freed in torch's cache;
    give them back before vLLM takes its memory again."""
    if placement.trainer_here and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_cpu_room(kv_bytes: int) -> None:
    """vLLM's CPU build takes the KV cache from NUMA node 0: say so in one line naming the key
    when it cannot, instead of a worker process's traceback."""
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info
    except ImportError:  # moved in another vLLM release: vLLM's own check still applies
        return
    available = get_memory_node_info(0).available_memory
    if kv_bytes > available:
        raise ConfigError(
            f"engine.kv_cache_bytes={kv_bytes / (1 << 30):.2f}GiB does not fit in the "
            f"{available / (1 << 30):.2f} GiB available on NUMA node 0; lower it "
            "(e.g. engine.kv_cache_bytes=512MiB) or free memory")


def _versions(spans: Sequence[Any] | None, count: int) -> tuple[int, ...]:
    """Per-token versions from vLLM's ``WeightVersionSpan`` list (``[start, end)`` per label)."""
    versions = [-1] * count
    for span in spans or ():
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    if -1 in versions:
        raise RuntimeError("vLLM returned tokens without a weight version label")
    return tuple(versions)


def _close_zmq(llm: Any) -> None:
    """Terminate the ZMQ context of vLLM's engine-core client: its async shutdown closes the
    sockets but leaves the context, which warns (ResourceWarning) when collected."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    ctx = getattr(resources, "ctx", None)
    if ctx is not None and not getattr(ctx, "closed", True):
        ctx.destroy(linger=0)
