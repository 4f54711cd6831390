"""A trainer of N ranks behind one :class:`Trainer`: the driver's proxy and the ranks' server.

``trainer.world_size=N`` (N >= 1) makes the launcher start N rank processes (local ones here,
:class:`ProcessRank`; Ray actors in :mod:`orchestrator.launch.ray.ranks`), each a
:class:`RankServer` around a :class:`~orchestrator.trainer.distributed.RankTrainer` built from
the run's recipe. :class:`RankGroup` is what the pipeline sees: every call goes to every rank at
once (the ranks meet in their collectives) and rank 0 answers: the step's metrics, the one
:class:`WeightUpdate` per step (gathered on rank 0, handed over once), the warm-start loss.
Checkpoints are :meth:`RankGroup.save` / :meth:`RankGroup.load`: every rank writes or reads its
``torch.distributed.checkpoint`` shards into the directory the atomic checkpoint store gives.

A rank that dies ends the run: its process group cannot lose a member, so the next call raises
:class:`RankLost` in one line, and every later call (a checkpoint after the crash included)
repeats it without waiting; the run resumes from its last periodic checkpoint with
``resume=``, at the same or another world size.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import anyio

from orchestrator.config.read import target_of
from orchestrator.errors import ConfigError, PolyRLError, RunAborted, first_line
from orchestrator.launch.base import TrainerRecipe
from orchestrator.trainer.base import Forwarded, TrainStats, combine_ranks
from orchestrator.trainer.proxy import Answer, TrainerProxy, answer_now
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate

RANK_TRAINER = "orchestrator.trainer.distributed.RankTrainer"
# what a local rank imports (_rank_context): the trainer and FSDP2's modules
RANK_MODULES = ("orchestrator.launch.ranks", "orchestrator.trainer.distributed",
                "torch.distributed.fsdp", "torch.distributed.checkpoint")
# After one rank's call failed, how long the others may take to finish theirs; past this they
# are waiting on it in a collective (gloo's own timeout is minutes) and are stopped.
STUCK_AFTER_S = 10.0


class RankLost(RunAborted):
    """A trainer rank died; the group cannot go on without it."""


def world_size(recipe: TrainerRecipe) -> int | None:
    """``trainer.world_size``: None for the one in-process trainer, else the number of ranks."""
    size = recipe.trainer.get("world_size")
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"trainer.world_size must be an integer >= 1 or null, got {size!r}")
    if not getattr(target_of(recipe.trainer), "trains_in_ranks", False):
        raise ConfigError(f"trainer.world_size={size} needs a trainer that trains in ranks "
                          f"(trainer._target_=orchestrator.trainer.TorchTrainer), not "
                          f"{recipe.trainer.get('_target_')}")
    return size


def rank_recipe(recipe: TrainerRecipe, spec: Any) -> TrainerRecipe:
    """``recipe`` building rank ``spec.rank`` (a :class:`RankSpec`) of the group."""
    trainer = {k: v for k, v in recipe.trainer.items() if k != "world_size"}
    return replace(recipe, trainer={**trainer, "_target_": RANK_TRAINER, "rank": spec})


@dataclass(frozen=True)
class RankStep:
    metrics: TrainStats
    version: int


class RankServer:
    """What a rank process does when the driver calls; blocking methods (run them off any
    event loop)."""

    def __init__(self, recipe: TrainerRecipe) -> None:
        from orchestrator.trainer.distributed import RankTrainer

        trainer = recipe.build()
        assert isinstance(trainer, RankTrainer)
        self.trainer = trainer
        self.recipe = recipe

    def version(self) -> int:
        return self.trainer.version

    def step(self, groups: Sequence[Group]) -> RankStep:
        metrics = self.trainer.train_step(groups)
        self.recipe.release_cached_memory()
        return RankStep(metrics, self.trainer.version)

    def gather(self) -> WeightUpdate | None:
        update = self.trainer.gather()
        self.recipe.release_cached_memory()
        return update

    def call(self, name: str, args: Sequence[Any]) -> Answer:
        """A forwarded :class:`Trainer` method (:mod:`orchestrator.trainer.proxy`)."""
        return answer_now(self.trainer, name, args)

    def stage(self) -> None:
        self.trainer.stage()

    def save(self, directory: str) -> None:
        self.trainer.save(Path(directory))

    def load(self, directory: str) -> int:
        self.trainer.load(Path(directory))
        return self.trainer.version

    def close(self) -> None:
        self.trainer.close()


class RankHandle(ABC):
    """The driver's line to one rank."""

    rank: int

    def pack(self, method: str, args: tuple[Any, ...]) -> Any:
        """The call as this kind of handle sends it (by default as it is). :meth:`RankGroup._each`
        packs a call once, in the caller's thread, and every rank's thread sends that one
        message: no two threads ever serialise the same arguments (see there)."""
        return method, args

    @abstractmethod
    def send(self, message: Any) -> Any:
        """Run the call :meth:`pack` made on the rank and return its result (blocking);
        raises :class:`RankLost` when the rank is gone."""

    def call(self, method: str, *args: Any) -> Any:
        """Run ``RankServer.<method>(*args)`` on the rank and return its result (blocking)."""
        return self.send(self.pack(method, args))

    def close(self) -> None:  # a handle may hold nothing
        pass

    def kill(self) -> None:
        """Stop the rank now (it is stuck in a collective whose peer failed)."""

    async def settle(self) -> None:
        """On the driver's event loop, once an awaited call of the group returned: record what
        the rank's replies brought besides their results (a Ray rank's spans, so they count in
        the step that made the call). A local rank process brings nothing."""


class RankGroup(TrainerProxy):
    """N ranks as one :class:`Trainer`; rank 0 answers for the group (the forwarded methods
    too: :meth:`RankServer.call` on every rank)."""

    def __init__(self, handles: Sequence[RankHandle]) -> None:
        self.handles = list(handles)
        self.world_size = len(self.handles)
        self._lost: RankLost | None = None
        # One call at a time over the whole group: every rank must see the calls in the same
        # order (a checkpoint written in a worker thread waits for the step in progress).
        self._order = threading.Lock()
        self.version = self._all_now("version")[0]

    def _all_now(self, method: str, *args: Any) -> list[Any]:
        """Call every rank at once (they meet in collectives) and wait for all of them."""
        with self._order:
            return self._each(method, *args)

    def _each(self, method: str, *args: Any) -> list[Any]:
        if self._lost is not None:
            raise RankLost(str(self._lost))
        results: list[Any] = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []
        finished = threading.Condition()
        done = [0]
        # Serialised once, here, not by each rank's thread: two threads pickling the same
        # objects at once (a step's groups) can leave CPython 3.11 with two instance dicts
        # sharing one values array, one of them freed with it, and the process then segfaults
        # in a later garbage collection (found from a core dump of the test suite's crash).
        message = self.handles[0].pack(method, args)

        def one(handle: RankHandle) -> None:
            try:
                results[handle.rank] = handle.send(message)
            except BaseException as error:  # noqa: BLE001 - collected and raised below
                errors.append((handle.rank, error))
            with finished:
                done[0] += 1
                finished.notify_all()

        threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in self.handles]
        for t in threads:
            t.start()
        with finished:
            finished.wait_for(lambda: done[0] == self.world_size or bool(errors))
            if errors:  # the others either fail too or wait on it in a collective
                finished.wait_for(lambda: done[0] == self.world_size, timeout=STUCK_AFTER_S)
        stuck = [h for h, t in zip(self.handles, threads, strict=True) if t.is_alive()]
        for handle in stuck:
            handle.kill()
        for t in threads:
            t.join()
        lost = [e for _, e in errors if isinstance(e, RankLost)]
        failed = [(rank, e) for rank, e in errors if not isinstance(e, RankLost)]
        if stuck and failed:
            rank, error = failed[0]
            self._lost = RankLost(
                f"trainer rank {rank} failed during {method} "
                f"({str(error)[:200] if isinstance(error, RankError) else first_line(error)}); the ranks "
                f"waiting on it were stopped and the run ends here: resume it from its last "
                f"checkpoint with resume=<run_dir>")
            raise self._lost from error
        if lost:  # the ranks that waited on the dead one fail too: report the death
            self._lost = lost[0]
            raise RankLost(str(lost[0])) from lost[0]
        if errors:
            raise errors[0][1]
        return results

    async def _all(self, method: str, *args: Any) -> list[Any]:
        results = await anyio.to_thread.run_sync(lambda: self._all_now(method, *args))
        for handle in self.handles:
            await handle.settle()
        return results

    async def step(self, groups: Sequence[Group]) -> TrainStats:
        done: RankStep = (await self._all("step", list(groups)))[0]
        self.version = done.version
        return done.metrics

    async def weights(self) -> WeightUpdate:
        update: WeightUpdate = (await self._all("gather"))[0]
        return update

    async def _forward(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        return self._answer(method, await self._all("call", method.name, tuple(args)))

    def _forward_now(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        return self._answer(method, self._all_now("call", method.name, tuple(args)))

    @staticmethod
    def _answer(method: Forwarded, answers: Sequence[Answer]) -> Answer:
        """The group's answer, combined as the method declares (``forwarded(ranks=…)``), with
        rank 0's version."""
        return combine_ranks(method.ranks, [result for result, _ in answers]), answers[0][1]

    def save(self, directory: Path) -> None:
        """Every rank writes its shards into ``directory`` (shared storage across nodes)."""
        self._all_now("save", str(directory))

    def snapshot(self) -> RankSnapshot:
        """Every rank copies its shards now; :meth:`RankSnapshot.write` writes those copies
        (the checkpoint store's two parts: the trainer waits only for the copy)."""
        self._all_now("stage")
        return RankSnapshot(self)

    def load(self, directory: Path) -> None:
        self.version = self._all_now("load", str(directory))[0]

    def state_dict(self) -> Mapping[str, Any]:
        raise TypeError("a group of trainer ranks saves shards: RankGroup.save(directory)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise TypeError("a group of trainer ranks loads shards: RankGroup.load(directory)")

    def close(self) -> None:
        for handle in self.handles:
            handle.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)


@dataclass
class RankSnapshot:
    """The shards the ranks of ``group`` copied, to be written into a checkpoint directory."""

    group: RankGroup

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        self.group.save(directory)
        return directory


# -- local processes (launcher=local) ---------------------------------------------------------


def _serve(conn: Any, recipe: TrainerRecipe, threads: int | None, gpu: str | None,
           environ: dict[str, str]) -> None:
    """A rank process: build the server, then answer calls until the pipe closes. ``environ``
    is the driver's environment as the rank was started (a fork server's child has the
    environment the server started with: a variable set or unset since, such as
    ``POLYRL_KILL_AT``, would otherwise not reach the rank)."""
    os.environ.clear()
    os.environ.update(environ)
    from orchestrator.allocator import keep_freed_memory

    keep_freed_memory()
    if gpu is not None:  # one GPU per rank, seen as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch

    torch.set_num_threads(threads or 1)
    try:
        server = RankServer(recipe)
    except BaseException as error:  # noqa: BLE001 - sent to the driver, which raises it
        conn.send(("error", _portable(error)))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            result = getattr(server, method)(*args)
            if isinstance(result, WeightUpdate):  # across the pipe as safetensors bytes
                result = result.serialised()
            conn.send(("ok", result))
        except BaseException as error:  # noqa: BLE001 - sent to the driver, which raises it
            conn.send(("error", _portable(error)))
        if method == "close":
            break


class RankError(PolyRLError, RuntimeError):
    """An error a rank raised that is not the project's own, carried to the driver as
    ``Type: message`` (the exception itself may not pickle)."""


def _portable(error: BaseException) -> BaseException:
    """The error itself when it pickles as the project's own, else one line of it."""
    if isinstance(error, PolyRLError):
        return error
    return RankError(f"{type(error).__name__}: {str(error).strip()[:2000]}")


def _rank_context() -> Any:
    """Local ranks start from multiprocessing's fork server, which imports what a rank runs
    (torch, transformers, the trainer) once per driver process and forks each rank from there:
    a new interpreter per rank (``spawn``) imported them again, about 8 CPU-seconds a rank on
    2 cores. Nothing there starts CUDA at import, so each rank still chooses its GPU
    (``CUDA_VISIBLE_DEVICES``) before CUDA starts, as under ``spawn``; each rank takes the
    driver's environment of the moment (:func:`_serve`), though what libraries read at import
    (OpenMP's settings) stays as the server had it."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_MODULES))
    return context


class ProcessRank(RankHandle):
    """A rank in a local process, over a pipe."""

    def __init__(self, rank: int, recipe: TrainerRecipe, threads: int | None,
                 gpu: str | None) -> None:
        self.rank = rank
        context = _rank_context()
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve,
                                       args=(child, recipe, threads, gpu, dict(os.environ)),
                                       name=f"polyrl-rank-{rank}", daemon=True)
        self.process.start()
        child.close()
        self._lock = threading.Lock()

    def _receive(self, doing: str) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as error:
            self.process.join(timeout=5)
            raise RankLost(
                f"trainer rank {self.rank} (pid {self.process.pid}) died during {doing} "
                f"(exit code {self.process.exitcode}); the run ends here: resume it from its last "
                f"checkpoint with resume=<run_dir>") from error
        if status == "error":
            raise value
        return value

    def started(self) -> None:
        with self._lock:
            self._receive("its start")

    def pack(self, method: str, args: tuple[Any, ...]) -> tuple[str, bytes]:
        """The call pickled as ``Connection.send`` pickles it (the rank's ``recv`` reads it)."""
        return method, bytes(ForkingPickler.dumps((method, args)))

    def send(self, message: tuple[str, bytes]) -> Any:
        method, payload = message
        with self._lock:
            try:
                self._conn.send_bytes(payload)
            except (BrokenPipeError, OSError) as error:  # it died before the call was sent
                self.process.join(timeout=5)
                raise RankLost(
                    f"trainer rank {self.rank} (pid {self.process.pid}) was gone before {method} "
                    f"(exit code {self.process.exitcode}); the run ends here: resume it from its "
                    f"last checkpoint with resume=<run_dir>") from error
            return self._receive(method)

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close")
            except (RankLost, RuntimeError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


def rank_gpus(size: int, model_device: str, visible: int,
              mask: str | None) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``size`` local rank processes, or None when
    ``model.device`` puts the model on the CPU. Rank 0 takes the GPU ``model.device`` names
    (``auto`` and ``cuda``: the first this process sees; the engine, in this process, is there
    too) and rank i the i-th after it; each rank sees only its own, as ``cuda:0``. ``visible``
    is how many GPUs this process sees and ``mask`` its own ``CUDA_VISIBLE_DEVICES`` (indices,
    UUIDs or MIG names, passed on as written: a rank given ``str(i)`` would take the machine's
    GPU i, which the mask may have left out)."""
    from orchestrator.engines.placement import device_index

    first = device_index(model_device, visible > 0)
    if first is None:
        return None
    if visible < first + size:
        seen = f"{visible} {'is' if visible == 1 else 'are'} visible here" + (
            f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
        raise ConfigError(f"trainer.world_size={size} from model.device={model_device} asks for "
                          f"GPUs {first} to {first + size - 1}, a GPU per rank, but {seen}")
    names = [n.strip() for n in mask.split(",")] if mask is not None else []
    if len(names) < visible:  # unset (or fewer names than CUDA found): plain indices
        names = [str(i) for i in range(visible)]
    return names[first:first + size]


def process_group(recipe: TrainerRecipe, size: int) -> RankGroup:
    """``size`` ranks in local processes on this machine (one GPU each, unless ``model.device``
    is the CPU: :func:`rank_gpus`)."""
    import torch

    from orchestrator.trainer.distributed import RankSpec, free_port

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = rank_gpus(size, str(recipe.model.get("device", "auto")), visible,
                     os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus is not None:  # each rank sees its one GPU as cuda:0
        recipe = replace(recipe, model={**recipe.model, "device": "cuda"})
    port = free_port()
    handles = []
    try:
        for rank in range(size):
            spec = RankSpec(rank, size, "127.0.0.1", port)
            handles.append(ProcessRank(rank, rank_recipe(recipe, spec), recipe.torch_threads,
                                       gpus[rank] if gpus else None))
        for handle in handles:
            handle.started()
        return RankGroup(handles)
    except BaseException:
        for handle in handles:
            handle.close()
        raise
