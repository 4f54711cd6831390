"""A trainer that lives elsewhere: the interface's forwarded methods, written once.

A :class:`~orchestrator.trainer.base.Trainer` method marked
:func:`~orchestrator.trainer.base.forwarded` is the same call wherever the trainer lives: its
arguments go to the trainer, its result comes back. Both ends are derived from that one
declaration:

* the driver's side, :class:`TrainerProxy` (the rank group of
  :mod:`orchestrator.launch.ranks`, the Ray trainer of ``orchestrator.launch.ray``), gets a
  method for each forwarded one it does not write out itself: the call's arguments are bound
  to the declaration's signature and sent, with the method's name, through the one transport a
  proxy implements (:meth:`TrainerProxy._forward`, and :meth:`TrainerProxy._forward_now` for
  the interface's blocking methods);
* the far side (the rank server, the trainer actor) answers every one of them with
  :func:`answer` or :func:`answer_now`: the method runs on the real trainer (a blocking one in
  a worker thread, a coroutine on an event loop) and ``(result, version)`` goes back, so the
  proxy's ``version`` follows a call that changed it (a checkpoint loaded, say). A name that is
  not a forwarded method of the interface is refused: this is not a ``getattr`` side door.

So adding a method to the trainer interface is its declaration in ``Trainer`` (marked, with a
default body for the trainers that lack it) and its body in the trainers that have it
(``TorchTrainer``); the launchers need no edit. The in-process trainers
(:class:`~orchestrator.trainer.TorchTrainer`, the simulated one) are not proxies: they implement
the interface directly.
"""

from __future__ import annotations

import functools
import inspect
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from orchestrator.trainer.base import Forwarded, Trainer, forwarded_methods

Answer = tuple[Any, int]  # a forwarded call's result, and the trainer's version after it


class TrainerProxy(Trainer):
    """A :class:`Trainer` whose forwarded methods go through :meth:`_forward`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__mro__[: cls.__mro__.index(TrainerProxy)]  # the proxy and its mixins
        for name, method in forwarded_methods().items():
            if not any(name in vars(c) for c in own):
                setattr(cls, name, _forwarder(method))

    @abstractmethod
    async def _forward(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        """Run ``method(*args)`` on the trainer; its :func:`answer`."""

    @abstractmethod
    def _forward_now(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        """The same, blocking (for the interface's blocking methods)."""


def _forwarder(method: Forwarded) -> Callable[..., Any]:
    signature = inspect.signature(method.function)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        bound = signature.bind(None, *args, **kwargs)  # None: self's place
        bound.apply_defaults()
        return bound.args[1:]

    if method.is_async:
        async def forward(self: TrainerProxy, *args: Any, **kwargs: Any) -> Any:
            result, self.version = await self._forward(method, bind(args, kwargs))
            return result
    else:
        def forward(self: TrainerProxy, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            result, self.version = self._forward_now(method, bind(args, kwargs))
            return result

    functools.update_wrapper(forward, method.function)
    forward.__isabstractmethod__ = False  # type: ignore[attr-defined]
    return forward


def _resolve(trainer: Trainer, name: str) -> tuple[Forwarded, Callable[..., Any]]:
    method = forwarded_methods().get(name)
    if method is None:
        raise TypeError(f"{name!r} is not a forwarded Trainer method (marked with "
                        f"orchestrator.trainer.base.forwarded)")
    return method, getattr(trainer, name)


async def answer(trainer: Trainer, name: str, args: Sequence[Any]) -> Answer:
    """Run the forwarded method ``name`` on ``trainer`` in this event loop (a blocking one in a
    worker thread)."""
    method, bound = _resolve(trainer, name)
    if method.is_async:
        result = await bound(*args)
    else:
        result = await anyio.to_thread.run_sync(lambda: bound(*args))
    return result, trainer.version


def answer_now(trainer: Trainer, name: str, args: Sequence[Any]) -> Answer:
    """The same, blocking, off any event loop (a coroutine gets a loop of its own)."""
    method, bound = _resolve(trainer, name)
    if not method.is_async:
        return bound(*args), trainer.version

    async def call() -> Any:
        return await bound(*args)

    return anyio.run(call), trainer.version
