"""Environments by name: the ``polyrl.envs`` entry-point group.

Every environment, built-in or third-party, is an :class:`~envs.base.EnvSpec` subclass named
by an entry point in the ``polyrl.envs`` group (``name = "package.module:SpecClass"``): this
project declares its own in ``pyproject.toml`` exactly as a plug-in package does, so a new
environment needs no edit here. In Hydra, ``conf/env/<name>.yaml`` names the class with
``_target_`` like every other group; for an installed plug-in without a shipped file,
:func:`register_hydra_configs` stores a config built from its class's keyword arguments and
their defaults, so ``env=<name> env.<arg>=…`` works too.
"""

from __future__ import annotations

import inspect
import logging
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from envs.base import EnvSpec

ENTRY_POINT_GROUP = "polyrl.envs"
log = logging.getLogger(__name__)


@cache
def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            log.warning("environment %s (%s) ignored: the name is taken by %s",
                        ep.name, ep.value, found[ep.name].value)
            continue
        found[ep.name] = ep
    return found


def available() -> list[str]:
    return sorted(_entry_points())


@cache
def spec_class(name: str) -> type[EnvSpec]:
    """The class registered as ``name``; KeyError (unknown) or TypeError (not an EnvSpec)."""
    eps = _entry_points()
    if name not in eps:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(available())}")
    cls = eps[name].load()
    if not (inspect.isclass(cls) and issubclass(cls, EnvSpec)):
        raise TypeError(f"environment {name!r} ({eps[name].value}) is not an EnvSpec subclass")
    cls.name = name
    return cls


def make_spec(name: str, **kwargs: Any) -> EnvSpec:
    return spec_class(name)(**kwargs)


def target(cls: type) -> str:
    """The dotted path Hydra's ``_target_`` names ``cls`` by."""
    return f"{cls.__module__}.{cls.__qualname__}"


def default_config(name: str) -> dict[str, Any]:
    """``{"_target_": <class>, **keyword defaults}`` of a registered spec (``???`` if required)."""
    cls = spec_class(name)
    config: dict[str, Any] = {"_target_": target(cls)}
    for param in inspect.signature(cls.__init__).parameters.values():
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
    """Make every registered env without a shipped ``conf/env`` file selectable in Hydra; a
    plug-in that fails to load is reported and left out, the others still work."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name in available():
        if name in shipped:
            continue
        try:
            node = default_config(name)
        except Exception as e:  # noqa: BLE001 - one broken plug-in must not stop the rest
            log.warning("environment plug-in %s failed to load: %s", name, e)
            continue
        store.store(group="env", name=name, node=node, provider="polyrl.envs")
