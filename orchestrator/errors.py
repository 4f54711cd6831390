"""The project's exceptions, in one place.

``ConfigError`` is the one a user sees: its message is a single sentence naming the key or
value to change, and the entry point prints it without a traceback.
"""


class PolyRLError(Exception):
    """Base class for errors raised by this project."""


class ConfigError(PolyRLError, ValueError):
    """A configuration key or value a user must change."""


class EngineClosed(PolyRLError):
    """A request reached an engine that has been shut down."""


class RunAborted(PolyRLError):
    """The run cannot go on (its trainer died, every engine is gone): the message says why in
    one line, and the entry point prints it without a traceback."""


def chain(error: BaseException) -> list[BaseException]:
    """``error`` and everything behind it, breadth first, each once: causes, contexts and the
    members of exception groups (a task group's crash wraps the error that ended it)."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop(0)
        if any(e is f for f in found):
            continue
        found.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return found


def first_line(error: BaseException) -> str:
    """``Type: the first line of its message`` (200 characters at most)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__
