"""Turning the composed Hydra config into typed settings, with one-sentence errors.

Hydra's struct mode already rejects unknown keys. :func:`typed` builds a plain section
(``pipeline``, ``rollout``, …) as its class in :mod:`orchestrator.config.schema`, which pydantic
validates; :func:`check_node` checks a ``_target_`` node's keys against the annotated
constructor it names, before Hydra builds it; each turns a mistake into one line naming the
key. Sizes that only make sense together (a batch must fit the dataset) are checked where the
parts meet. :func:`explain` turns a configuration mistake, however Hydra or OmegaConf raised it,
into the one line the command line prints.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hydra.errors import HydraException, InstantiationException, MissingConfigException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from envs.base import EnvSpec
from envs.errors import EnvConfigError
from orchestrator.config import schema
from orchestrator.errors import ConfigError, RunAborted, chain
from sandboxes.api import EngineUnavailable, ImageMissing

CONF = Path(__file__).resolve().parents[2] / "conf"  # the shipped config groups

T = TypeVar("T")


def section(cfg: DictConfig, key: str) -> dict[str, Any]:
    node = OmegaConf.select(cfg, key)
    if node is None:
        raise ConfigError(f"the config has no '{key}' section")
    return OmegaConf.to_container(node, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def typed(cls: type[T], cfg: DictConfig, key: str) -> T:
    """The section ``cfg.<key>`` built as ``cls`` (one of :mod:`orchestrator.config.schema`'s, which
    checks every value against its field); a mistake is one line naming the key."""
    values = section(cfg, key)
    fields = schema.fields(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key '{key}.{unknown[0]}'; known: {', '.join(sorted(fields))}")
    return cls(**values)


def scalar(cfg: DictConfig, key: str) -> Any:
    """The value of the dotted ``key`` (``seed``, ``pipeline.num_steps``), checked against its
    type in :mod:`orchestrator.config.schema`."""
    return schema.check(key, OmegaConf.select(cfg, key), schema.annotation(key))


def check_accepts(fn: Callable[..., Any], values: dict[str, Any], key: str) -> None:
    """Check ``values`` against the annotated parameters of ``fn`` (a class or function)."""
    target = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError):  # unresolvable annotations: nothing to check against
        return
    params = inspect.signature(target).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in values.items():
        if name.startswith("_"):
            continue
        if name not in params and not takes_any:
            known = ", ".join(p for p in params if p != "self")
            raise ConfigError(f"unknown config key '{key}.{name}'; known: {known}")
        if isinstance(value, dict) and isinstance(value.get("_target_"), str):
            check_node(value, f"{key}.{name}")  # a nested piece, built by Hydra too
            continue
        if isinstance(value, dict) and value and all(
                isinstance(v, dict) and "_target_" in v or v is None for v in value.values()):
            for piece, node in value.items():  # pieces by name (algo.corrections.tis)
                if node is not None:
                    check_node(node, f"{key}.{name}.{piece}")
            continue
        if name in hints:
            schema.check(f"{key}.{name}", value, hints[name])


def check_target(cfg: DictConfig, key: str) -> None:
    """Type-check the keys of a ``_target_`` node (and of the nodes nested in it) before Hydra
    instantiates it."""
    check_node(section(cfg, key), key)


def target_of(values: Mapping[str, Any]) -> Any:
    """What a node's ``_target_`` names, or None where it names nothing that imports (building
    the node says what is wrong, in one line): for asking a class what it can do before it is
    built (``trains_in_ranks``, ``cheap_copy_on_cpu``)."""
    try:
        return get_object(str(values.get("_target_")))
    except Exception:  # noqa: BLE001 - hydra raises a bare ImportError/ValueError mix here
        return None


def check_node(values: dict[str, Any], key: str) -> None:
    target = values.get("_target_")
    if not isinstance(target, str):
        raise ConfigError(f"{key}._target_ is missing: name the class or function to build")
    try:
        fn = get_object(target)
    except Exception as e:  # hydra raises a bare ImportError/ValueError mix here
        raise ConfigError(f"{key}._target_={target} cannot be imported") from e
    check_accepts(fn, values, key)



def build_env(cfg: DictConfig) -> EnvSpec:
    """The environment ``cfg.env`` names (:func:`env_from`)."""
    check_target(cfg, "env")
    return env_from(section(cfg, "env"))


def env_from(values: dict[str, Any]) -> EnvSpec:
    """The environment the ``env`` node ``values`` names by ``_target_`` (its other keys are the
    keyword arguments; nested nodes such as ``sandbox`` arrive as plain mappings, for the spec
    to build)."""
    try:
        spec = instantiate(values, _recursive_=False, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e  # a constructor's ValueError names the key already
        raise ConfigError(str(cause).splitlines()[0]) from e
    if not isinstance(spec, EnvSpec):
        raise ConfigError(f"env._target_={values['_target_']} is not an environment (EnvSpec)")
    return spec


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``overrides`` (a command line's ``key=value`` and ``group=option``) applied to a config
    composed already (a run's saved ``config.yaml``), in place: an option of a config group
    (``engine=vllm``) replaces that node as Hydra composes it from ``conf/``, with the
    overrides of its keys (``engine.max_num_seqs=64``), its interpolations resolved against
    ``cfg``; any other key takes its value, read as YAML (``eval.k=[1,4]``). A key ``cfg``
    does not have is refused in one line (``+key=value`` adds it)."""
    import yaml
    from hydra import compose, initialize_config_dir

    parsed = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise ConfigError(f"{override} is not a key=value override")
        parsed.append((key.lstrip("+"), key.startswith("+"), value))
    groups = {key for key, _, _ in parsed if (CONF / key).is_dir()}
    if groups:
        group_overrides = [o for o, (key, _, _) in zip(overrides, parsed, strict=True)
                           if key.split(".")[0] in groups]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = compose("config", overrides=group_overrides)
        for group in groups:
            cfg[group] = OmegaConf.create(OmegaConf.to_container(composed[group], resolve=False))
    missing = object()
    for key, add, value in parsed:
        if key.split(".")[0] in groups:
            continue
        if not add and OmegaConf.select(cfg, key, default=missing) is missing:
            raise ConfigError(f"unknown config key '{key}': check its spelling, or add a new key "
                              f"with +{key}=…")
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def register_plugin_envs() -> None:
    """Environments from installed plug-in packages become ``env=<name>`` options."""
    from envs.registry import register_hydra_configs

    register_hydra_configs({p.stem for p in (CONF / "env").glob("*.yaml")})


def report(error: BaseException) -> int:
    """A command's ending for ``error``: its one sentence on stderr and exit status 2 when it
    is a configuration mistake (:func:`explain`); otherwise it is raised again, traceback and
    all."""
    message = explain(error)
    if message is None:
        raise error
    print(f"error: {message}", file=sys.stderr)
    return 2


def explain(error: BaseException) -> str | None:
    """One sentence for a configuration mistake, or None if ``error`` is not one (a bug, which
    keeps its traceback)."""
    causes = chain(error)  # the error behind a task group's crash, too
    for e in causes:
        # not a bug (EnvConfigError: an env.* value, found when the run starts it, e.g. a judge
        # endpoint that does not answer)
        if isinstance(e, (ConfigError, EnvConfigError, RunAborted, EngineUnavailable, ImageMissing)):
            return str(e)
        if isinstance(e, MissingMandatoryValue):
            key = getattr(e, "full_key", None) or "a required key"
            return f"{key} must be set, e.g. {key}=…"
    if isinstance(error, MissingConfigException):
        missing = re.search(r"Could not find '([^']+)/([^'/]+)'", str(error))
        options = re.findall(r"^\t(\S+)$", str(error), flags=re.MULTILINE)
        if missing:
            group, name = missing.groups()
            listed = f"; available: {', '.join(options)}" if options else ""
            return f"unknown {group} '{name}'{listed}"
    if isinstance(error, InstantiationException):
        # A bad argument is the user's to fix; anything else (out of memory, a bug) is not.
        for e in causes[1:]:
            if isinstance(e, (ValueError, TypeError)):
                return f"{e}".splitlines()[0]
        return None
    text = str(error)
    if isinstance(error, ValueError) and "Config group override must be a string" in text:
        return ("a config group is switched off with ~<group> (e.g. ~algo/filter), not "
                "<group>=null")
    override = re.search(r"Could not override '([^']+)'", text)
    if override:
        key = override.group(1)
        return f"unknown config key '{key}': check its spelling, or add a new key with +{key}=…"
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return " ".join(lines[:2]) if lines else type(error).__name__
    return None
