"""``trainer.world_size=N`` under ``launcher=ray``: N rank actors behind one :class:`RankGroup`.

The launcher gives each :class:`RankActor` a bundle of the run's placement group (the first N,
``launcher.trainer`` each: GPUs, CPUs, custom resources). Rank 0's actor names its node's
address and a free port; every actor then joins the process group there (gloo on CPU, NCCL when
Ray gave it a GPU, which it sees as ``cuda:0``) and builds its
:class:`~orchestrator.trainer.distributed.RankTrainer` from the run's recipe.

Per step the driver sends the batch to every rank (:class:`~orchestrator.launch.ranks.RankGroup`)
and asks every rank to gather: rank 0 puts the full weights (or the LoRA adapters) into the
object store once, and the engines pull them from there as from a single trainer actor. Spans:
``train_compute`` per rank, ``weights_gather`` on rank 0 (``gather_seconds``, ``put_seconds``,
``bytes``), each back with its call's reply and recorded by the group before the step goes on
(:meth:`RayRank.settle`), so they count in their step. Checkpoint shards are written by each
rank on its own node: the run directory must be on storage every trainer node sees (the same
machine, or a shared file system).

A rank actor is not restarted (its process group cannot take a new member): a dead one ends
the run with :class:`~orchestrator.launch.ranks.RankLost`, resumable from the last checkpoint
with ``resume=`` at the same or another world size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import ray
import torch

from orchestrator.errors import first_line
from orchestrator.launch.base import TrainerRecipe
from orchestrator.launch.ranks import RankGroup, RankHandle, RankLost, RankServer, rank_recipe
from orchestrator.launch.ray.actors import _Reporting
from orchestrator.launch.ray.remote import RayActorError, result_now
from orchestrator.launch.ray.spans import Reply, SpanBuffer, SpanCollector
from orchestrator.trace.recorder import Span
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate


def rank_name(rank: int) -> str:
    """Rank ``rank``'s actor's name in its spans and in the span collector."""
    return f"trainer-{rank}"


class RankActor(_Reporting):
    """One trainer rank in a Ray actor (asyncio: the blocking work runs in a worker thread)."""

    def __init__(self, name: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self._name = name
        self._spans = SpanBuffer(name)
        self._server: RankServer | None = None

    async def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on its node, for the process group: the address
        Ray reaches the node by (the host name's may be a loopback one, 127.0.1.1 under
        Debian's /etc/hosts, which ranks on other nodes cannot reach)."""
        from orchestrator.trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    async def start(self, recipe: TrainerRecipe) -> int:
        self._server = await anyio.to_thread.run_sync(RankServer, recipe)
        return self._server.version()

    def _built(self) -> RankServer:
        if self._server is None:
            raise RuntimeError(f"{self._name} was not started")
        return self._server

    async def call(self, method: str, *args: Any) -> Any:
        """``RankServer.<method>(*args)``; a step and a gather reply with their spans."""
        server = self._built()
        if method == "step":
            return await self._step(server, *args)
        if method == "gather":
            return await self._gather(server)
        return await anyio.to_thread.run_sync(lambda: getattr(server, method)(*args))

    async def _step(self, server: RankServer, groups: Sequence[Group]) -> Reply[Any]:
        with self._spans.span("train_compute", server.version(),
                              samples=sum(len(g) for g in groups)):
            done = await anyio.to_thread.run_sync(server.step, groups)
        return self._spans.reply(done)

    async def _gather(self, server: RankServer) -> Reply[WeightUpdate | None]:
        started = time.time()
        update = await anyio.to_thread.run_sync(server.gather)
        if update is None:
            return self._spans.reply(None)
        put = time.time()
        shared = await anyio.to_thread.run_sync(update.to_object_store)
        self._spans.add("weights_gather", started, time.time(), update.version,
                        bytes=shared.nbytes, put_seconds=time.time() - put,
                        adapters=update.adapters is not None, **dict(update.stats))
        return self._spans.reply(shared)


class RayRank(RankHandle):
    """The driver's line to one rank actor, watched in ``spans`` as ``name``: the spans a reply
    brings are held (the call runs in a thread of its own) until :meth:`settle` records them."""

    def __init__(self, rank: int, actor: Any, spans: SpanCollector, name: str) -> None:
        self.rank = rank
        self.actor = actor
        self.spans = spans
        self.name = name
        self._held: list[Span] = []
        self._lock = threading.Lock()  # calls append from their threads, settle takes on the loop

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def pack(self, method: str, args: tuple[Any, ...]) -> tuple[str, list[Any]]:
        """Each argument put in the object store once for every rank (an argument that is an
        ``ObjectRef`` already goes as it is); the actor gets the values."""
        return method, [a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args]

    def send(self, message: tuple[str, list[Any]]) -> Any:
        method, args = message
        try:
            done = result_now(self.actor.call.remote(method, *args))
        except RayActorError as error:
            raise RankLost(
                f"trainer rank {self.rank}'s actor died during {method} ({first_line(error)}); "
                f"the run ends here: resume it from its last checkpoint with resume=<run_dir>"
            ) from error
        if not isinstance(done, Reply):
            return done
        with self._lock:
            self._held.extend(done.spans)
        return done.value

    async def settle(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        await self.spans.receive(self.name, Reply(None, tuple(held)))


def ray_rank_group(recipe: TrainerRecipe, size: int, make_actor: Callable[[int], Any],
                   spans: SpanCollector) -> RankGroup:
    """``size`` rank actors (``make_actor(rank)`` places each, watched in ``spans`` by
    :func:`rank_name`) joined into one group."""
    from orchestrator.trainer.distributed import RankSpec

    actors = [make_actor(rank) for rank in range(size)]
    try:
        address, port = result_now(actors[0].rendezvous.remote())
        result_now([actor.start.remote(rank_recipe(recipe, RankSpec(rank, size, address, port)))
                    for rank, actor in enumerate(actors)])
    except RayActorError as error:
        raise RankLost(f"a trainer rank's actor died while the group was built: "
                       f"{first_line(error)}") from error
    return RankGroup([RayRank(rank, actor, spans, rank_name(rank))
                      for rank, actor in enumerate(actors)])
