"""An LLM judge as a reward: ``env.reward=judge`` (alone or as a weighted term).

A judge model grades each reply against the question and the reference answer, as verl's
generative reward models, ROLL's judge cluster and ART's RULER do:

* **Prompt.** A rubric template (:data:`DEFAULT_TEMPLATE`, or ``env.judge.template``: the text,
  or the path of a file holding it) with three fields, ``{question}`` (the task's prompt: its
  last user message, or every message as ``role: content`` lines when there are several turns),
  ``{reply}`` (the model's reply) and ``{answer}`` (the reference answer). Any other field, or
  a template without ``{reply}``, is refused when the run is built. Literal braces are doubled
  (``{{`` / ``}}``), as in :meth:`str.format`.
* **Endpoint.** Any OpenAI-compatible server: ``POST {url}/chat/completions`` with ``model``,
  the one user message, ``temperature`` and ``max_tokens``; the key read from the environment
  variable ``api_key_env`` (sent as ``Authorization: Bearer``), none when that is null. Or a
  model the run serves itself: ``serve`` names a ``conf/model`` entry (``tiny``, ``smollm2``)
  instead of ``url``, and the training or evaluation command builds that model's engine from
  its own weights (no trainer), puts it behind :class:`orchestrator.gateway.serve.ModelServer`
  in the run's own event loop, and hands its URL in (:meth:`Judge.use_url`) before the
  environment starts; the environments never import the orchestrator.
* **Score.** The number in the reply's last ``<score>…</score>``, else the number the last
  non-empty line is (``7``, ``Score: 7``, ``7/10``, ``0.7``), divided by ``scale`` (or by the
  line's own ``/N``) so it lies in [0, 1]. Anything else, or a number outside ``[0, scale]``, is
  a counted failure (``unparsable``).
* **Limits.** At most ``concurrency`` calls at once (the rest wait their turn, holding nothing);
  each call under ``timeout_s`` of wall-clock time (connect, send, read); a call that timed out,
  could not connect, or got a 5xx or 429 is tried again after ``backoff_s`` (doubled each time,
  with jitter), ``retries`` times. A 4xx other than 429 and an unparsable answer are not
  retried (the same request would get them again). A sample is therefore decided within
  ``(retries + 1) * timeout_s`` plus the backoffs, whatever the server does.
* **Counters** (cumulative, in the run's metrics): ``judge/calls`` (HTTP attempts),
  ``judge/scored``, ``judge/unscored`` (samples that got no score: they score 0),
  ``judge/in_flight`` (calls not answered yet, a gauge: with ``retries=0`` every call is
  scored, unscored or in flight, at every step's report), and
  ``judge/failures/<kind>`` for every failed attempt, by kind: ``timeout``, ``connection``,
  ``server_error`` (5xx), ``rate_limited`` (429), ``client_error`` (other 4xx),
  ``bad_response`` (not a chat completion), ``unparsable``.
* **Start.** :meth:`Judge.__aenter__` opens the HTTP session and asks ``GET {url}/models``
  within ``start_timeout_s``: a server that does not answer, or refuses the key (401/403), is
  an :class:`~envs.errors.EnvConfigError` of one line, before any episode runs. Any other
  answer counts as up (a 404, a server without that route or a URL without its ``/v1``, with a
  warning).

Judging overlaps rollout: :meth:`Judge.score` is a coroutine awaited in the episode's own task
(through :class:`envs.rewards.Scorer`), so while one episode waits on its judge the others
generate. The HTTP client is aiohttp, a dependency of the project already (the search client,
the gateway), not the ``openai`` SDK (an optional extra): the retries, their backoff and the
count of every failure by kind are this module's, where the SDK would retry inside itself.

Limits: a judge sees text, not token ids; one call per sample (no self-consistency vote); the
score is not cached (a judge at a temperature above 0 may grade one reply twice differently).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import string
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio

from envs.errors import EnvConfigError

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = """\
You grade an answer to a question against the reference answer.

Question:
{question}

Answer to grade:
{reply}

Reference answer:
{answer}

Is the final answer given equivalent to the reference answer? Ignore style and working; \
judge only the final answer. Reply with one line: <score>10</score> if it is correct, \
<score>0</score> if it is wrong or missing."""

FIELDS = frozenset({"question", "reply", "answer"})
FAILURES = ("timeout", "connection", "server_error", "rate_limited", "client_error",
            "bad_response", "unparsable")
_RETRIED = frozenset({"timeout", "connection", "server_error", "rate_limited"})


@dataclass(frozen=True)
class JudgeConfig:
    """``env.judge``: where the judge is and how it is asked."""

    url: str | None = None  # the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    # or a conf/model entry (tiny, smollm2) the run serves itself on an engine of its own, its
    # URL handed in (Judge.use_url) by the orchestrator before the run starts
    serve: str | None = None
    model: str = "judge"  # the model name sent with each call
    api_key_env: str | None = None  # the environment variable holding the key (null: no key)
    template: str | None = None  # the rubric: its text or a file's path (null: the default)
    scale: float = 10.0  # the score a fully right answer gets; scores are divided by it
    max_tokens: int = 256  # the judge's reply length
    temperature: float = 0.0  # the judge's sampling temperature
    timeout_s: float = 30.0  # wall-clock limit of one call
    retries: int = 2  # further tries of a call that timed out, could not connect, or got 5xx/429
    backoff_s: float = 0.5  # the wait before the first retry, doubled for each next one
    concurrency: int = 32  # calls in flight at once
    start_timeout_s: float = 10.0  # how long the endpoint may take to answer at start

    @classmethod
    def of(cls, value: Mapping[str, Any] | JudgeConfig | None, key: str = "env.judge") -> JudgeConfig:
        """``env.judge`` as a config: unknown keys and bad values refused in one line."""
        if isinstance(value, JudgeConfig):
            config = value
        else:
            value = dict(value or {})
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise EnvConfigError(f"{key} has an unknown key {unknown[0]!r}; its keys: "
                                     f"{', '.join(sorted(known))}")
            config = cls(**value)
        config.check(key)
        return config

    def check(self, key: str = "env.judge") -> None:
        for name in ("scale", "temperature", "timeout_s", "backoff_s", "start_timeout_s",
                     "max_tokens", "retries", "concurrency"):
            value = getattr(self, name)
            whole = name in ("max_tokens", "retries", "concurrency")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise EnvConfigError(f"{key}.{name} must be {'an integer' if whole else 'a number'}"
                                     f", got {value!r}")
        for name in ("url", "serve", "model", "api_key_env", "template"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise EnvConfigError(f"{key}.{name} must be a string, got {value!r}")
        if self.url and self.serve:
            raise EnvConfigError(f"{key}.url and {key}.serve are both set: the judge is either "
                                 f"a server at a URL or a model the run serves; set the other "
                                 f"to null")
        if self.serve:
            return self._check_limits(key)
        if not self.url:
            raise EnvConfigError(f"env.reward=judge needs {key}.url, the judge's OpenAI-"
                                 f"compatible base URL, e.g. {key}.url=http://127.0.0.1:8000/v1, "
                                 f"or {key}.serve, a conf/model entry the run serves itself "
                                 f"(e.g. {key}.serve=smollm2)")
        if not self.url.startswith(("http://", "https://")):
            raise EnvConfigError(f"{key}.url must start with http:// or https://, got {self.url!r}")
        self._check_limits(key)

    def _check_limits(self, key: str) -> None:
        for name in ("timeout_s", "start_timeout_s", "scale"):
            if not getattr(self, name) > 0:
                raise EnvConfigError(f"{key}.{name} must be > 0, got {getattr(self, name)}")
        for name, low in (("retries", 0), ("concurrency", 1), ("max_tokens", 1)):
            if getattr(self, name) < low:
                raise EnvConfigError(f"{key}.{name} must be >= {low}, got {getattr(self, name)}")
        if self.backoff_s < 0 or self.temperature < 0:
            raise EnvConfigError(f"{key}.backoff_s and {key}.temperature must be >= 0")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise EnvConfigError(f"{key}.api_key_env names {self.api_key_env}, which is not set: "
                                 f"export it, or set {key}.api_key_env=null for a server "
                                 "without keys")


def load_template(value: str | None, key: str = "env.judge.template") -> str:
    """The rubric: ``value``'s text, or the file it names (no ``{`` in it and a file there);
    checked to use only :data:`FIELDS`, ``{reply}`` among them."""
    if value is None:
        text = DEFAULT_TEMPLATE
    elif "{" not in value and Path(value).expanduser().is_file():
        text = Path(value).expanduser().read_text()
    else:
        text = value
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:
        raise EnvConfigError(f"{key} is not a valid template ({e}); write literal braces as "
                             "{{ and }}") from e
    unknown = sorted(used - FIELDS)
    if unknown:
        raise EnvConfigError(f"{key} uses an unknown field {{{unknown[0]}}}; its fields: "
                             "{question}, {reply}, {answer}")
    if "reply" not in used:
        raise EnvConfigError(f"{key} must contain {{reply}}, the reply to grade")
    return text


def question_text(prompt: Sequence[Mapping[str, str]] | str) -> str:
    """The prompt as the template's ``{question}``: the text of a one-turn prompt (its last
    user message; a system message is left out), else every message as ``role: content``."""
    if isinstance(prompt, str):
        return prompt
    turns = [m for m in prompt if m.get("role") != "system"]
    if len(turns) == 1:
        return str(turns[0].get("content", ""))
    return "\n".join(f"{m.get('role')}: {m.get('content', '')}" for m in turns)


_TAG = re.compile(r"<score>\s*([^<]*?)\s*</score>", re.IGNORECASE | re.DOTALL)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_VALUE = re.compile(rf"^(?P<n>{_NUMBER})\s*(?:/\s*(?P<d>{_NUMBER}))?$")
_LINE = re.compile(rf"^(?:[*#\s]*(?:final\s+)?(?:score|grade|rating)\s*[:=]?\s*)?\**\s*"
                   rf"(?P<v>{_NUMBER}(?:\s*/\s*{_NUMBER})?)\s*\**\s*\.?\s*$", re.IGNORECASE)


def parse_score(text: str, scale: float = 10.0) -> float | None:
    """The judge's score in [0, 1]: the last ``<score>`` tag's number, else the number the last
    non-empty line is, over ``scale`` (or the ``/N`` given with it); None when there is none or
    it lies outside the scale."""
    tags = _TAG.findall(text)
    value: str | None = None
    if tags:
        value = tags[-1].strip()
    else:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        match = _LINE.match(lines[-1]) if lines else None
        value = match.group("v") if match else None
    if value is None:
        return None
    match = _VALUE.match(value)
    if match is None:
        return None
    number = float(match.group("n"))
    top = float(match.group("d")) if match.group("d") else scale
    if not (math.isfinite(number) and top > 0 and 0 <= number <= top):
        return None
    return number / top


@dataclass(frozen=True)
class Verdict:
    """A sample's judgement: its score (None: unscored, after ``attempts`` calls that failed, the
    last for ``failure``), and the judge's last reply (for a record)."""

    score: float | None
    attempts: int
    failure: str | None = None
    text: str = ""


class _Failed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class Judge:
    """A judge endpoint, held open as an async context manager (the HTTP session, checked at
    start). :meth:`score` grades one ``(prompt, completion, answer)``."""

    def __init__(self, config: JudgeConfig | Mapping[str, Any] | None,
                 key: str = "env.judge") -> None:
        self.config = JudgeConfig.of(config, key)
        self.template = load_template(self.config.template, f"{key}.template")
        self.key = key
        self.counters: Counter[str] = Counter()
        self._session: Any = None  # aiohttp.ClientSession while open
        self._slots: anyio.Semaphore | None = None
        self._last_warning = 0.0
        self.last_failure = ""  # the latest failure's kind and detail, for a report

    @property
    def base_url(self) -> str:
        return str(self.config.url).rstrip("/")

    def use_url(self, url: str) -> None:
        """Where the model the run serves itself (``serve``) answers, once it is up: the
        orchestrator hands it in as plain data, as it would a hosted judge's URL."""
        self.config = replace(self.config, url=url)

    def _headers(self) -> dict[str, str]:
        name = self.config.api_key_env
        return {"Authorization": f"Bearer {os.environ[name]}"} if name else {}

    async def __aenter__(self) -> Self:
        import aiohttp

        if not self.config.url:  # serve: the orchestrator starts it and hands in its URL
            raise EnvConfigError(f"{self.key}.serve={self.config.serve}: the run serves this "
                                 f"judge itself (python -m orchestrator, python -m "
                                 f"orchestrator.commands.eval), which this command does not; set "
                                 f"{self.key}.url to a running server instead")
        self._slots = anyio.Semaphore(self.config.concurrency)
        self._session = aiohttp.ClientSession(
            headers=self._headers(),
            connector=aiohttp.TCPConnector(limit=self.config.concurrency),
            timeout=aiohttp.ClientTimeout(total=None))  # each call has its own cancel scope
        try:
            await self._check_start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with anyio.CancelScope(shield=True):
                await session.close()

    async def _check_start(self) -> None:
        import aiohttp

        url = f"{self.base_url}/models"
        limit = self.config.start_timeout_s
        try:
            with anyio.fail_after(limit):
                async with self._session.get(url) as response:
                    status = response.status
                    await response.read()
        except TimeoutError as e:
            raise EnvConfigError(f"{self.key}.url={self.config.url}: the judge did not answer "
                                 f"GET /models within {limit:g} s (start_timeout_s); is the "
                                 "server up at that address?") from e
        except (aiohttp.ClientError, OSError) as e:
            raise EnvConfigError(f"{self.key}.url={self.config.url}: the judge does not answer "
                                 f"({type(e).__name__}: {e}); start the server or fix the URL"
                                 ) from e
        if status in (401, 403):
            where = f"${self.config.api_key_env}" if self.config.api_key_env else \
                f"no key ({self.key}.api_key_env is null)"
            raise EnvConfigError(f"{self.key}.url={self.config.url} refused the key ({status}): "
                                 f"check {where}")
        if status == 404:  # up, but perhaps not where the chat route is
            log.warning("%s.url=%s answered 404 to GET /models; if its calls fail as "
                        "judge/failures/client_error, check the URL's path (it usually ends "
                        "in /v1)", self.key, self.config.url)

    def prompt(self, prompt: Sequence[Mapping[str, str]] | str, completion: str,
               answer: str) -> str:
        """The rubric filled for one sample."""
        return self.template.format(question=question_text(prompt), reply=completion,
                                    answer=answer)

    async def score(self, prompt: Sequence[Mapping[str, str]] | str, completion: str,
                    answer: str) -> Verdict:
        """Grade ``completion`` to ``prompt`` against ``answer``: a :class:`Verdict` with a score
        in [0, 1], or with none after the failures the limits allow (each counted)."""
        if self._session is None or self._slots is None:
            raise RuntimeError("Judge.score() outside `async with judge:`")
        body = {"model": self.config.model,
                "messages": [{"role": "user", "content": self.prompt(prompt, completion, answer)}],
                "temperature": self.config.temperature, "max_tokens": self.config.max_tokens}
        attempts, wait = 0, self.config.backoff_s
        while True:
            attempts += 1
            try:
                text = await self._call(body)
            except _Failed as e:
                failure, text = e, ""
            else:
                value = parse_score(text, self.config.scale)
                if value is not None:
                    self.counters["scored"] += 1
                    return Verdict(value, attempts, None, text)
                failure = _Failed("unparsable", repr(text[-200:]))
            self._count(failure)
            if failure.kind not in _RETRIED or attempts > self.config.retries:
                self.counters["unscored"] += 1
                return Verdict(None, attempts, failure.kind, text)
            await anyio.sleep(wait * random.uniform(0.5, 1.5))
            wait *= 2

    async def _call(self, body: dict[str, Any]) -> str:
        """One attempt: the judge's reply text, or _Failed naming its kind."""
        import aiohttp

        assert self._slots is not None
        async with self._slots:
            self.counters["calls"] += 1
            self.counters["in_flight"] += 1
            try:
                with anyio.fail_after(self.config.timeout_s):
                    async with self._session.post(f"{self.base_url}/chat/completions",
                                                  json=body) as response:
                        status, raw = response.status, await response.read()
            except TimeoutError as e:
                raise _Failed("timeout", f"no answer within {self.config.timeout_s:g} s") from e
            except (aiohttp.ClientError, OSError) as e:
                raise _Failed("connection", f"{type(e).__name__}: {e}") from e
            finally:  # the caller counts it scored, unscored or failed before its next await
                self.counters["in_flight"] -= 1
        if status >= 500:
            raise _Failed("server_error", f"HTTP {status}: {raw[:200]!r}")
        if status == 429:
            raise _Failed("rate_limited", f"HTTP 429: {raw[:200]!r}")
        if status >= 400:
            raise _Failed("client_error", f"HTTP {status}: {raw[:200]!r}")
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Failed("bad_response", f"not a chat completion: {raw[:200]!r}") from e
        if not isinstance(content, str):
            raise _Failed("bad_response", f"the message's content is {type(content).__name__}")
        return content

    def _count(self, failure: _Failed) -> None:
        self.counters[f"failures/{failure.kind}"] += 1
        self.last_failure = str(failure)[:300]
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line in 10 s: the counters say the rest
            log.warning("judge call failed (%s); judge/failures/* count every kind", failure)
            self._last_warning = now

    def metrics(self) -> dict[str, float]:
        out = {f"judge/{name}": float(self.counters[name])
               for name in ("calls", "scored", "unscored", "in_flight")}
        for kind in FAILURES:
            out[f"judge/failures/{kind}"] = float(self.counters[f"failures/{kind}"])
        return out
