"""Environments by name: ``env=<name>`` in Hydra selects ``conf/env/<name>.yaml``, whose
``name`` key is looked up here and whose other keys are the spec's keyword arguments."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from envs.base import EnvSpec

_REGISTRY: dict[str, type[EnvSpec]] = {}
_BUILTINS = ("envs.arithmetic",)

S = TypeVar("S", bound=type[EnvSpec])


def register_env(name: str) -> Callable[[S], S]:
    def decorate(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def available() -> list[str]:
    for module in _BUILTINS:
        importlib.import_module(module)
    return sorted(_REGISTRY)


def spec_class(name: str) -> type[EnvSpec]:
    names = available()
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(names)}")
    return _REGISTRY[name]


def make_spec(name: str, **kwargs: Any) -> EnvSpec:
    return spec_class(name)(**kwargs)
