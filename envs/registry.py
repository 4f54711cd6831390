"""Environments by name.

Built-ins register themselves with :func:`register_env`; third-party packages declare an
entry point in the ``polyrl.envs`` group (``name = "package.module:SpecClass"``) and need no
edit to this project. ``env=<name>`` in Hydra selects ``conf/env/<name>.yaml`` when the
project ships one; for a plug-in, :func:`register_hydra_configs` stores a config built from
its class's keyword arguments and their defaults, so ``env=<name> env.<arg>=…`` works too.
The ``name`` key of the env config is looked up here; the other keys are the spec's
keyword arguments.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from envs.base import EnvSpec

ENTRY_POINT_GROUP = "polyrl.envs"
_REGISTRY: dict[str, type[EnvSpec]] = {}
_BUILTINS = ("envs.arithmetic", "envs.search_qa", "envs.code")
_loaded = False
log = logging.getLogger(__name__)

S = TypeVar("S", bound=type[EnvSpec])


def register_env(name: str) -> Callable[[S], S]:
    def decorate(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for module in _BUILTINS:
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            log.warning("environment plug-in %s (%s) ignored: the name is taken", ep.name, ep.value)
            continue
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - one broken plug-in must not stop the rest
            log.warning("environment plug-in %s (%s) failed to load: %s", ep.name, ep.value, e)
            continue
        if not (inspect.isclass(cls) and issubclass(cls, EnvSpec)):
            log.warning("environment plug-in %s (%s) is not an EnvSpec subclass", ep.name, ep.value)
            continue
        register_env(ep.name)(cls)
    _loaded = True


def available() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def spec_class(name: str) -> type[EnvSpec]:
    names = available()
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(names)}")
    return _REGISTRY[name]


def make_spec(name: str, **kwargs: Any) -> EnvSpec:
    return spec_class(name)(**kwargs)


def default_config(name: str) -> dict[str, Any]:
    """``{"name": name, **keyword defaults}`` of a registered spec (``???`` when required)."""
    config: dict[str, Any] = {"name": name}
    for param in inspect.signature(spec_class(name).__init__).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = param.default
        if default is inspect.Parameter.empty:
            config[param.name] = "???"
        elif isinstance(default, tuple):
            config[param.name] = list(default)
        else:
            config[param.name] = default
    return config


def register_hydra_configs(shipped: set[str]) -> None:
    """Make every registered env without a shipped ``conf/env`` file selectable in Hydra."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name in available():
        if name not in shipped:
            store.store(group="env", name=name, node=default_config(name), provider="polyrl.envs")
