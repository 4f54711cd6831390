"""The vLLM engine's GPU routes as far as a CPU can check them (in .venv-vllm): the calls a
colocated engine makes to vLLM around a train step (sleep, wake the weights, load, label, wake
the KV cache), a weight update through vLLM's trainer-side transfer engine instead of
``collective_rpc``, and the two adapters of :mod:`orchestrator.engines.vllm_transfer`.

vLLM itself is replaced by a recorder of calls (``FakeLLM``) and CUDA is pretended: what these
check is the order and the arguments of our calls, not vLLM's behaviour on a GPU, which
``test_vllm_gpu.py`` checks where there is one."""

from __future__ import annotations

import asyncio
import base64
import pickle
import threading
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

from helpers import TINY_MODEL

from orchestrator.engines.base import sync_weights
from orchestrator.engines.placement import Placement
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.weights.update import WeightUpdate

pytestmark = [
    pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class FakeLLM:
    """Records the ``AsyncLLM`` calls made to it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, *args, *sorted(kwargs.items())))
            await anyio.sleep(0.01)
            return True

        return call

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.threads: list[bool] = []

    def send(self, tensors: Any) -> None:
        self.threads.append(threading.current_thread() is not threading.main_thread())
        self.sent.append(sorted(tensors))


def engine_on_pretend_gpu(monkeypatch: pytest.MonkeyPatch, colocate: bool,
                          transfer: str = "rpc") -> VLLMEngine:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = VLLMEngine(TINY_MODEL, gpu_memory_utilization=0.5, kv_cache_bytes="64MiB",
                        weight_transfer=transfer,  # type: ignore[arg-type]
                        placement=Placement(trainer_gpu=0, colocate=colocate))
    engine._llm = FakeLLM()
    return engine


def an_update(version: int) -> WeightUpdate:
    return WeightUpdate.by_reference(version, {"w": torch.ones(2)}, leased=False)


async def test_a_colocated_engine_sleeps_for_the_step_and_wakes_weights_before_kv_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_on_pretend_gpu(monkeypatch, colocate=True)
    assert engine._options["enable_sleep_mode"] is True
    assert engine._options["gpu_memory_utilization"] == 0.5
    llm = engine._llm
    await engine.sleep()
    await engine.sleep()  # asleep already: nothing more
    await sync_weights(engine, an_update(2))
    assert llm.names() == ["sleep", "wake_up", "collective_rpc", "update_weight_version",
                           "wake_up"]
    assert llm.calls[0] == ("sleep", ("level", 1), ("mode", "keep"))
    assert llm.calls[1] == ("wake_up", ("tags", ["weights"]))
    assert llm.calls[3] == ("update_weight_version", "2")  # labelled before vLLM resumes
    assert llm.calls[4] == ("wake_up", ("tags", ["kv_cache"]))  # which resumes its scheduler
    assert engine.version == 2 and not engine._asleep and not engine._paused


async def test_a_sleep_waits_for_the_weight_sync_in_progress(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_on_pretend_gpu(monkeypatch, colocate=True)
    llm = engine._llm
    async with anyio.create_task_group() as tg:
        tg.start_soon(sync_weights, engine, an_update(1))
        await anyio.sleep(0.005)  # the sync has paused the engine
        await engine.sleep()
    assert llm.names() == ["pause_generation", "collective_rpc", "update_weight_version",
                           "resume_generation", "sleep"]


async def test_an_engine_of_its_own_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_on_pretend_gpu(monkeypatch, colocate=False)
    assert "enable_sleep_mode" not in engine._options
    await engine.sleep()
    await sync_weights(engine, an_update(1))
    assert engine._llm.names() == ["pause_generation", "collective_rpc", "update_weight_version",
                                   "resume_generation"]  # today's route, unchanged


@pytest.mark.parametrize("transfer", ["ipc", "nccl"])
async def test_a_gpu_backend_sends_through_vllms_engine_in_a_thread(
        monkeypatch: pytest.MonkeyPatch, transfer: str) -> None:
    placement = {"ipc": Placement(trainer_gpu=0), "nccl": Placement(trainer_gpu=1)}[transfer]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = VLLMEngine(TINY_MODEL, gpu_memory_utilization=0.5, kv_cache_bytes="64MiB",
                        weight_transfer="auto", placement=placement)
    assert engine.transfer == transfer
    assert engine._options["weight_transfer_config"].backend == transfer
    engine._llm = FakeLLM()
    engine._sender = sender = FakeSender()
    await sync_weights(engine, an_update(4))
    assert sender.sent == [["w"]] and sender.threads == [True]  # off the event loop
    assert engine._llm.names() == ["pause_generation", "update_weight_version",
                                   "resume_generation"]  # no collective_rpc: vLLM's engine
    assert engine.version == 4


async def test_the_loop_client_reaches_the_llm_from_another_thread() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    from orchestrator.engines.vllm_transfer import LoopClient

    llm = FakeLLM()
    client = LoopClient(llm, asyncio.get_running_loop())
    handles = [{"uuid": (torch.float32, b"handle", 3)}]

    def drive() -> None:  # what vLLM's trainer-side engine does, in its thread
        client.init_weight_transfer_engine({"packed": False})
        client.start_weight_update()
        client.update_weights({"names": ["w"], "ipc_handles": handles})
        client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
        client.finish_weight_update()

    await anyio.to_thread.run_sync(drive)
    assert llm.names() == ["init_weight_transfer_engine", "start_weight_update",
                           "update_weights", "update_weights", "finish_weight_update"]
    ipc: WeightTransferUpdateRequest = llm.calls[2][1]
    assert "ipc_handles" not in ipc.update_info  # types do not cross vLLM's msgpack channel
    assert pickle.loads(base64.b64decode(ipc.update_info["ipc_handles_pickled"])) == handles
    assert llm.calls[3][1].update_info == {"names": ["w"], "dtype_names": ["float32"],
                                           "shapes": [[2]]}


def test_the_source_declares_what_it_yields() -> None:
    from orchestrator.engines.vllm_transfer import UpdateSource

    source = UpdateSource(torch.device("cpu"))
    source.tensors = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    meta = source.metadata()
    pairs = list(source)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [
        (n, t.dtype, tuple(t.shape)) for n, t in pairs]
    assert list(source) and [m.name for m in meta] == ["a", "b"]  # a fresh pass each round


def test_tensor_parallel_workers_are_vllms_own_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a Ray actor of a placement group (launcher=ray) vLLM would otherwise choose its
    Ray executor and place its workers in the group's bundles, sized for the actor alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    split = VLLMEngine(TINY_MODEL, tensor_parallel_size=2, gpu_memory_utilization=0.5)
    assert split._options["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in VLLMEngine(TINY_MODEL)._options  # vLLM's "uni"


async def test_an_update_too_large_for_one_rpc_value_goes_through_a_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """vLLM's msgpack channel holds at most 4 GiB in one value (about 2 B bf16 parameters):
    past RPC_BYTES_MAX the update is written to shared memory and loaded from there."""
    from orchestrator.engines import vllm_engine

    engine = engine_on_pretend_gpu(monkeypatch, colocate=False)
    monkeypatch.setattr(vllm_engine, "SHM", tmp_path)
    await sync_weights(engine, an_update(1))  # 8 bytes: as bytes, as before
    monkeypatch.setattr(vllm_engine, "RPC_BYTES_MAX", 4)
    loaded: list[tuple[str, dict[str, torch.Tensor]]] = []
    calls = engine._llm.calls

    async def collective_rpc(method: str, args: tuple[Any, ...]) -> list[int]:
        from safetensors.torch import load_file

        calls.append(("collective_rpc", method))
        loaded.append((args[0], load_file(args[0])))  # what a worker reads, there at the call
        return [1]

    engine._llm.collective_rpc = collective_rpc
    await sync_weights(engine, an_update(2))
    rpcs = [c[1] for c in calls if c[0] == "collective_rpc"]
    assert rpcs == ["polyrl_load_bytes", "polyrl_load_file"]
    [(path, tensors)] = loaded
    assert path.startswith(str(tmp_path)) and torch.equal(tensors["w"], torch.ones(2))
    assert list(tmp_path.iterdir()) == []  # removed once loaded
    assert engine.version == 2
