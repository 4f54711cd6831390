"""A trainer method is defined once (orchestrator/trainer/proxy.py): every proxy gets each
forwarded method of the interface, a call reaches the real trainer with its arguments bound as
the interface declares them, its result and the trainer's version come back, and a name that
is not forwarded is refused. The rank group is driven here over in-process handles around a
real trainer; tests/orchestrator/trainer/test_trainer_ranks.py and tests/orchestrator/launch/
run the same calls over processes and Ray actors."""

from __future__ import annotations

import inspect
import multiprocessing
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from orchestrator.algo.grpo import GRPO
from orchestrator.launch.ranks import ProcessRank, RankGroup, RankHandle
from orchestrator.models.policy import Policy
from orchestrator.trainer.base import (
    Forwarded,
    Trainer,
    combine_ranks,
    forwarded,
    forwarded_methods,
)
from orchestrator.trainer.proxy import Answer, TrainerProxy, answer, answer_now
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost
from orchestrator.trainer.torch_trainer import TorchTrainer


class Loopback(TrainerProxy):
    """A proxy whose transport is a function call: the far side's answer, in this process."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.version = trainer.version
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    async def step(self, groups: Sequence[Any]) -> dict[str, float]:
        raise AssertionError("not forwarded: a proxy writes its step out")

    async def weights(self) -> Any:
        raise AssertionError("not forwarded: a proxy writes its weights out")

    async def _forward(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        self.sent.append((method.name, tuple(args)))
        return await answer(self.trainer, method.name, args)

    def _forward_now(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        self.sent.append((method.name, tuple(args)))
        return answer_now(self.trainer, method.name, args)


class Server:
    """The rank server's side of the protocol around any trainer (a rank's is a RankTrainer)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def version(self) -> int:
        return self.trainer.version

    def call(self, name: str, args: Sequence[Any]) -> Answer:
        return answer_now(self.trainer, name, args)


class InProcessRank(RankHandle):
    def __init__(self, rank: int, server: Server) -> None:
        self.rank = rank
        self.server = server

    def send(self, message: tuple[str, tuple[Any, ...]]) -> Any:
        method, args = message
        return getattr(self.server, method)(*args)


class PipeRank(ProcessRank):
    """A local rank's packing and pipe, with a thread at the far end instead of a process."""

    def __init__(self, rank: int) -> None:
        self.rank, self._lock = rank, threading.Lock()
        self._conn, far = multiprocessing.Pipe()
        threading.Thread(target=self._far_end, args=(far,), daemon=True).start()

    @staticmethod
    def _far_end(far: Any) -> None:
        with far:
            while True:
                try:
                    method, args = far.recv()
                except EOFError:
                    return
                far.send(("ok", 0 if method == "version" else (method, len(args))))


PICKLED_IN: list[int] = []  # the thread of each Counted pickled


class Counted:
    def __reduce__(self) -> tuple[Any, ...]:
        PICKLED_IN.append(threading.get_ident())
        return (Counted, ())


def test_a_group_call_is_serialised_once_in_the_callers_thread() -> None:
    """Each rank's thread sends the one message the group packed. When each thread pickled the
    call itself, two threads pickled a step's groups at once, which can leave CPython 3.11 with
    two instance dicts sharing one values array; freeing one corrupted the other, and the test
    suite's process segfaulted in a later garbage collection (seen in a core dump)."""
    PICKLED_IN.clear()
    group = RankGroup([PipeRank(rank) for rank in range(3)])
    try:
        assert group._all_now("echo", Counted(), [Counted()]) == [("echo", 2)] * 3
    finally:
        for handle in group.handles:
            handle._conn.close()
    assert PICKLED_IN == [threading.get_ident()] * 2  # each argument once, here


def test_every_proxy_has_every_forwarded_method_with_the_interfaces_signature() -> None:
    from orchestrator.launch.ray.trainer import RayTrainer

    methods = forwarded_methods()
    assert {"supervised_step", "state_dict", "load_state_dict"} <= set(methods)
    for proxy in (Loopback, RankGroup, RayTrainer):
        assert not proxy.__abstractmethods__, proxy
        for name, method in methods.items():
            ours = getattr(proxy, name)
            if name in vars(proxy):  # written out (a rank group saves shards, not a state dict)
                continue
            assert inspect.signature(ours) == inspect.signature(method.function), (proxy, name)
            assert ours.__doc__ == method.function.__doc__
            assert inspect.iscoroutinefunction(ours) is method.is_async
    assert RankGroup.state_dict is not Trainer.state_dict  # its own: shards, not a dict


def test_a_forwarded_call_reaches_the_trainer_and_the_version_comes_back() -> None:
    simulated = SimulatedTrainer(TokenCost(), version=3)
    proxy = Loopback(simulated)
    assert proxy.state_dict() == {"version": 3, "busy": 0.0}
    proxy.load_state_dict(state={"version": 7, "busy": 1.5})  # a keyword, bound by position
    assert simulated.version == proxy.version == 7 and simulated.busy == 1.5
    assert proxy.sent == [("state_dict", ()), ("load_state_dict", ({"version": 7, "busy": 1.5},))]
    with pytest.raises(NotImplementedError, match="SimulatedTrainer has no supervised warm"):
        anyio.run(proxy.supervised_step, [[1, 2]], [[False, True]], 1e-3)


def test_a_name_that_is_not_forwarded_is_refused() -> None:
    simulated = SimulatedTrainer(TokenCost())
    for name in ("step", "weights", "snapshot", "__class__", "busy"):
        with pytest.raises(TypeError, match="not a forwarded Trainer method"):
            answer_now(simulated, name, ())


def test_a_rank_group_forwards_a_warm_start_step_like_the_trainer_itself(
        make_policy: Any) -> None:
    """The same warm-start step on a trainer and through a group of one rank over it: the
    same loss, and afterwards the same weights."""
    sequences, masks = [[1, 5, 6, 7], [1, 8, 9]], [[False, True, True, True], [False, True, True]]

    def trainer(policy: Policy) -> TorchTrainer:
        return TorchTrainer(policy, GRPO())

    direct = trainer(make_policy(0))
    served = trainer(make_policy(0))
    group = RankGroup([InProcessRank(0, Server(served))])
    assert group.version == 0
    for _ in range(2):
        want = anyio.run(direct.supervised_step, sequences, masks, 1e-2)
        got = anyio.run(group.supervised_step, sequences, masks, 1e-2)  # through answer_now
        assert got == pytest.approx(want, rel=1e-6)
    for (name, a), b in zip(direct.model.state_dict().items(),
                            served.model.state_dict().values(), strict=True):
        assert a.equal(b), name
    assert group.version == 0


@pytest.mark.parametrize("target", ["orchestrator.trainer.TorchTrainer",
                                    "orchestrator.trainer.torch_trainer.TorchTrainer",
                                    "orchestrator.trainer.distributed.RankTrainer"])
def test_world_size_takes_a_trainer_that_trains_in_ranks(target: str) -> None:
    from orchestrator.launch.base import TrainerRecipe
    from orchestrator.launch.ranks import world_size

    recipe = TrainerRecipe(trainer={"_target_": target, "world_size": 2}, model={}, algo={})
    assert world_size(recipe) == 2


@pytest.mark.parametrize("target", ["orchestrator.trainer.simulated.SimulatedTrainer",
                                    "orchestrator.trainer.no_such.Trainer"])
def test_world_size_with_a_trainer_that_cannot_is_one_line_naming_the_key(target: str) -> None:
    from orchestrator.errors import ConfigError
    from orchestrator.launch.base import TrainerRecipe
    from orchestrator.launch.ranks import world_size

    recipe = TrainerRecipe(trainer={"_target_": target, "world_size": 2}, model={}, algo={})
    with pytest.raises(ConfigError, match=r"^trainer.world_size=2 needs a trainer that trains "
                                          rf"in ranks .*, not {target}$"):
        world_size(recipe)


@pytest.mark.parametrize(("how", "want"), [
    ("first", {"loss": 1.0, "tokens": 3}),
    ("sum", {"loss": 6.0, "tokens": 10, "skipped": 1}),
    ("gather", [{"loss": 1.0, "tokens": 3}, {"loss": 2.0, "tokens": 7},
                {"loss": 3.0, "skipped": 1}]),
])
def test_a_rank_group_combines_its_ranks_answers_as_the_method_declares(how: str,
                                                                        want: Any) -> None:
    """Every rank answers a forwarded call; the group's one answer is rank 0's, their sum (by
    key for mappings) or all of them, as ``forwarded(ranks=…)`` declares, with rank 0's
    version."""
    def declared(self: Any) -> Any: ...

    method = Forwarded("declared", declared, "a test call", None, how)  # type: ignore[arg-type]
    answers = [({"loss": 1.0, "tokens": 3}, 4), ({"loss": 2.0, "tokens": 7}, 4),
               ({"loss": 3.0, "skipped": 1}, 4)]
    assert RankGroup._answer(method, answers) == (want, 4)
    assert combine_ranks("sum", [1.5, 2.5]) == 4.0


def test_every_forwarded_method_declares_how_ranks_answer_and_a_wrong_word_is_refused() -> None:
    assert {m.ranks for m in forwarded_methods().values()} <= {"first", "sum", "gather"}
    with pytest.raises(ValueError, match="choose first, sum or gather"):
        forwarded(doing="x", ranks="mean")  # type: ignore[arg-type]
