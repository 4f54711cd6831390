"""Many engines seen by the pipeline as one ``InferenceEngine``: routing, weight sync fan-out,
and replicas that go and come back.

:class:`EngineRouter` is the one router, used by the Ray launcher (engines in actors,
:mod:`orchestrator.launch.ray.engines`) and by the replay (``replay.engines`` replicas of the
fitted server model, :mod:`orchestrator.replay.run`). What differs between them is given to it:

* **Routing** (``routing``). ``least_loaded``: the replica with the fewest requests in flight
  (routed to it and not yet returned), ties broken by ``tiebreak`` (by default the fewest
  requests routed so far; the replay breaks them by resident tokens), then by order.
  ``round_robin``: replicas in turn.
* **Affinity** (``affinity``), so a prefix cache is hit. :class:`PrefixAffinity`: prompts are
  hashed in blocks of :data:`BLOCK` tokens (the last, partial block too), and a request goes to
  the replica that took the longest prefix it shares, while that replica has at most ``slack``
  more in flight than the least-loaded one — a group's samples (one prompt) and an episode's
  later turns (its earlier prompt extended) find the replica holding their prefix.
  :class:`EpisodeAffinity`: a later turn of an episode goes to the replica that served its
  previous turn, the episode named by a key function (the replay's plan key: no hashing).
  ``None``: routing alone.
* **Keeping replicas** (``keeper``). :class:`Keeper` (the default) runs in-process engines:
  ``async with router`` enters every engine's context, and nothing fails over. The Ray
  launcher's keeper starts engines in actors, notices lost ones, has Ray restart them, and
  brings them back on the latest weights; a request that fails with one of its
  ``lost_errors`` runs again on another replica, and routing waits up to its
  ``restart_timeout_s`` for a replica to be up before failing with :class:`EnginesLost`.

Weight sync: ``pause``, ``update_weights`` and ``resume`` go to every replica that is up, at
once (a weight load of ``sync_seconds`` therefore costs that once per update, on every
replica); :attr:`EngineRouter.version` is the version of the last completed update. The keeper
holds back replicas joining while a sync is under way, so none joins with older weights.
Counters (:meth:`EngineRouter.metrics`): the replicas' own, summed, and the keeper's.
Limits: requests are never split across replicas mid-generation.
"""

from __future__ import annotations

import math
import typing
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Self

import anyio
from anyio import AsyncContextManagerMixin

from orchestrator.config.schema import Routing
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError, RunAborted
from orchestrator.types import Generation, SamplingParams
from orchestrator.weights.update import WeightUpdate

ROUTING: tuple[Routing, ...] = typing.get_args(Routing)
BLOCK = 16  # tokens per prefix block
MAX_PREFIXES = 1 << 16  # prefix blocks remembered (least recently used dropped)


class EnginesLost(RunAborted):
    """No replica came back within the keeper's restart timeout."""


@dataclass(eq=False)
class Replica:
    """One engine behind the router, and the router's bookkeeping for it."""

    engine: InferenceEngine
    name: str
    index: int
    up: bool = False  # routable
    incarnation: int = 0  # how many times it came up
    inflight: int = 0  # requests routed to it and not yet returned
    routed: int = 0  # requests routed to it, in all


def prefix_blocks(prompt_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's blocks: entry ``i`` stands for its first ``i + 1`` blocks."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(prompt_ids), BLOCK):
        previous = hash((previous, tuple(prompt_ids[start:start + BLOCK])))
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    """A prompt to the replica holding its longest known prefix, within ``slack`` of the least
    loaded (None: no affinity)."""

    def __init__(self, slack: int | None = 8) -> None:
        self.slack = slack
        self._prefixes: OrderedDict[int, Replica] = OrderedDict()

    def route(self, prompt_ids: Sequence[int], candidates: list[Replica],
              pick: Callable[[], Replica]) -> Replica:
        chosen = pick()
        if self.slack is None:
            return chosen
        blocks = prefix_blocks(prompt_ids)
        for block in reversed(blocks):  # the longest prefix some replica took
            holder = self._prefixes.get(block)
            if holder is None:
                continue
            if holder in candidates and holder.inflight <= chosen.inflight + self.slack:
                chosen = holder
            break
        for block in blocks:
            self._prefixes[block] = chosen
            self._prefixes.move_to_end(block)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)
        return chosen


class EpisodeAffinity:
    """A later turn of an episode to the replica of its previous turn; ``episode(prompt)`` is
    the episode's key (None: not known) and the prompt's turn."""

    def __init__(self, episode: Callable[[Sequence[int]], tuple[int | None, int]]) -> None:
        self.episode = episode
        self._home: dict[int, Replica] = {}  # episode key -> the replica of its last turn

    def route(self, prompt_ids: Sequence[int], candidates: list[Replica],
              pick: Callable[[], Replica]) -> Replica:
        key, turn = self.episode(prompt_ids)
        home = self._home.get(key) if key is not None and turn > 0 else None
        if home is not None and home in candidates:
            return home
        chosen = pick()
        if key is not None:
            self._home[key] = chosen
        return chosen


Affinity = PrefixAffinity | EpisodeAffinity


class Keeper:
    """In-process replicas: each engine's own context, entered with the router's; none is
    ever lost."""

    lost_errors: tuple[type[BaseException], ...] = ()  # a request failing so runs elsewhere
    restart_timeout_s: float = math.inf  # how long routing waits for a replica to be up

    @asynccontextmanager
    async def running(self, router: EngineRouter) -> AsyncIterator[None]:
        """The replicas up while the router runs (``router.joined`` each as it comes up)."""
        async with AsyncExitStack() as stack:
            for replica in router.replicas:
                await stack.enter_async_context(replica.engine)
                router.joined(replica)
            yield

    async def hold(self) -> None:
        """Before a weight sync: no replica joins until :meth:`release`."""

    async def release(self) -> None: ...

    def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """``update`` as the replicas take it."""
        return update

    def lose(self, replica: Replica, incarnation: int, error: BaseException,
             rerun: bool) -> None:
        """``replica``'s ``incarnation`` failed a call with one of :attr:`lost_errors`
        (``rerun``: a request that runs again elsewhere)."""

    def metrics(self) -> dict[str, float]:
        return {}


class EngineRouter(AsyncContextManagerMixin, InferenceEngine):
    def __init__(self, engines: Sequence[InferenceEngine], *,
                 names: Sequence[str] | None = None,
                 routing: str = "least_loaded",
                 affinity: Affinity | None = None,
                 tiebreak: Callable[[Replica], float] | None = None,
                 keeper: Keeper | None = None,
                 version: int | None = None) -> None:
        if not engines:
            raise ConfigError("a router needs at least one engine")
        if routing not in ROUTING:
            raise ConfigError(f"routing={routing} must be {' or '.join(repr(r) for r in ROUTING)}")
        names = names or [f"engine-{i}" for i in range(len(engines))]
        self.replicas = [Replica(e, n, i) for i, (e, n) in enumerate(zip(engines, names,
                                                                           strict=True))]
        self.routing = routing
        self.affinity = affinity
        self.tiebreak = tiebreak or (lambda r: r.routed)
        self.keeper = keeper or Keeper()
        self.version = engines[0].version if version is None else version
        self._turn = 0  # round robin's next replica
        self._paused = False
        self._changed: anyio.Event | None = None  # set (and replaced) when a replica comes up

    @property
    def engines(self) -> list[InferenceEngine]:
        return [r.engine for r in self.replicas]

    # -- lifecycle -------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        """``async with router:`` its keeper's replicas up, in the caller's task."""
        self._changed = anyio.Event()
        async with self.keeper.running(self):
            yield self

    def joined(self, replica: Replica) -> None:
        """The keeper brought ``replica`` up (again): route to it."""
        replica.up = True
        replica.incarnation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    # -- InferenceEngine -------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        failed: dict[str, int] = {}  # replica -> the incarnation that failed this request
        while True:
            replica = await self.choose(prompt_ids, failed)
            incarnation = replica.incarnation
            replica.inflight += 1
            try:
                generation = await replica.engine.generate(prompt_ids, sampling)
                return replace(generation, engine=replica.name)
            except self.keeper.lost_errors as error:
                failed[replica.name] = incarnation
                self.keeper.lose(replica, incarnation, error, rerun=True)
            finally:
                replica.inflight -= 1

    async def choose(self, prompt_ids: Sequence[int],
                     failed: dict[str, int] | None = None) -> Replica:
        """The replica for ``prompt_ids``, skipping those down and the incarnations in
        ``failed`` (replica name -> incarnation); waits for one to be up."""
        failed = failed or {}
        candidates = self._candidates(failed)
        if not candidates:
            candidates = await self._wait_for_candidates(failed)
        pick = partial(self._pick, candidates)
        chosen = pick() if self.affinity is None else self.affinity.route(prompt_ids, candidates,
                                                                          pick)
        chosen.routed += 1
        return chosen

    def _candidates(self, failed: dict[str, int]) -> list[Replica]:
        return [r for r in self.replicas if r.up and failed.get(r.name) != r.incarnation]

    async def _wait_for_candidates(self, failed: dict[str, int]) -> list[Replica]:
        timeout = self.keeper.restart_timeout_s
        try:
            with anyio.fail_after(timeout):
                while not (candidates := self._candidates(failed)):
                    assert self._changed is not None, "a router routes inside `async with`"
                    await self._changed.wait()
                return candidates
        except TimeoutError:
            raise EnginesLost(f"no engine was running for launcher.engine_restart_timeout_s="
                              f"{timeout:g} seconds") from None

    def _pick(self, candidates: list[Replica]) -> Replica:
        if self.routing == "round_robin":
            chosen = candidates[self._turn % len(candidates)]
            self._turn += 1
            return chosen
        return min(candidates, key=lambda r: (r.inflight, self.tiebreak(r)))

    async def pause(self) -> None:
        if self._paused:
            return
        await self.keeper.hold()  # replicas joining finish first; none start
        self._paused = True
        try:
            await self._each(lambda e: e.pause())
        except BaseException:
            self._paused = False
            with anyio.CancelScope(shield=True):
                await self.keeper.release()
            raise

    async def update_weights(self, update: WeightUpdate) -> None:
        update = self.keeper.prepare(update)
        await self._each(lambda e: e.update_weights(update))
        self.version = update.version

    @property
    def attests(self) -> bool:
        """Whether every replica attests; each reports its own :attr:`fingerprint`, and what
        a replica generates carries its name (:attr:`Generation.engine`)."""
        return all(r.engine.attests for r in self.replicas)

    @property
    def fingerprints(self) -> dict[str, tuple[int, str | None]]:
        """Each replica's name -> the version and fingerprint it reports."""
        return {r.name: (r.engine.version, r.engine.fingerprint) for r in self.replicas}

    async def resume(self) -> None:
        if not self._paused:
            return
        try:
            await self._each(lambda e: e.resume())
        finally:
            self._paused = False
            with anyio.CancelScope(shield=True):
                await self.keeper.release()

    async def sleep(self) -> None:
        await self._each(lambda e: e.sleep())

    async def _each(self, call: Callable[[InferenceEngine], Awaitable[None]]) -> None:
        """``call`` on every replica that is up, at once; one lost meanwhile is left to the
        keeper, which brings it back on the latest weights."""

        async def one(replica: Replica) -> None:
            incarnation = replica.incarnation
            try:
                await call(replica.engine)
            except self.keeper.lost_errors as error:
                self.keeper.lose(replica, incarnation, error, rerun=False)

        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                if replica.up:
                    tg.start_soon(one, replica)

    def metrics(self) -> dict[str, float]:
        summed: dict[str, float] = {}
        for engine in self.engines:
            for key, value in engine.metrics().items():
                summed[key] = summed.get(key, 0.0) + value
        return {**summed, **self.keeper.metrics()}
