"""The environments' exceptions, in one place.

This package may not import :mod:`orchestrator` (the layers run orchestrator -> envs ->
sandboxes), so its errors have a base of their own, :class:`EnvError`, as the sandboxes have
:class:`sandboxes.api.SandboxError`; the orchestrator turns a constructor's error into its
``ConfigError`` when it builds an environment from config (``orchestrator.config.read.build_env``).
"""


class EnvError(Exception):
    """Base class for errors raised by an environment."""


class EnvConfigError(EnvError, ValueError):
    """An ``env.*`` value a user must change: one sentence naming the key."""


class EnvNotRunning(EnvError, RuntimeError):
    """An episode started outside ``async with spec.running():``, which holds the service or
    sandbox pool the environment needs."""
