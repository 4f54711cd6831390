"""The torch engine's requests and its resident batch (:mod:`~orchestrator.engines.torch_engine`):
what one request has generated so far, with each token's log-prob, version and the fingerprint
of the weights that sampled it, and the sequences resident in the KV cache.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from orchestrator.engines.slot_cache import SlotCache
from orchestrator.types import FinishReason, Generation, SamplingParams


class Pending:
    """The fingerprint of the weights just loaded, computed once: by the engine's next decoding
    step, in its thread, before it samples a token of those weights (:meth:`TorchEngine.
    _advance`), or by whoever needs it first (an idle engine's :meth:`TorchEngine.attested`).
    Not in a thread of its own: beside the trainer's step and the engine's, a third thread on
    two cores cost the default experiment 3 to 5% of its samples/s (docs/attestation.md)."""

    def __init__(self, compute: Callable[[], str]) -> None:
        self._compute = compute
        self._lock = threading.Lock()
        self.value: str | None = None

    def run(self) -> str:
        with self._lock:
            if self.value is None:
                self.value = self._compute()
            return self.value

    async def result(self) -> str:
        return self.value if self.value is not None else await anyio.to_thread.run_sync(self.run)


async def known(print_: str | Pending | None) -> str | None:
    """A fingerprint, once the engine's thread has computed it."""
    return await print_.result() if isinstance(print_, Pending) else print_


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    budget: int = 0  # tokens it may generate: max_tokens, capped by the context
    start_version: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # version -> the fingerprint of its weights (pending until the engine's step computes it)
    fingerprints: dict[int, str | Pending | None] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    fed: int = 0  # tokens of prompt + generated that are in the KV cache
    # its own uniform variates when ``sampling.seed`` is set: what it samples then depends on
    # its seed alone, not on the requests it shares a step with or its row among them
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.rng = random.Random(self.sampling.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + generated."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.token_ids[i - n]

    def add(self, token: int, logprob: float, version: int,
            fingerprint: str | Pending | None = None) -> None:
        """Record one sampled token; it stops on a stop token or at its budget."""
        if fingerprint is not None:
            self.fingerprints.setdefault(version, fingerprint)
        if not self.token_ids:
            self.start_version = version
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.token_ids) >= self.budget:
            self.finish_reason = FinishReason.LENGTH

    def finish(self, reason: FinishReason) -> None:
        """End it and hand it out now."""
        self.finish_reason = reason
        self.done.set()

    async def attested(self) -> None:
        """Its versions' fingerprints, once the engine has computed them."""
        for version, print_ in self.fingerprints.items():
            self.fingerprints[version] = await known(print_)

    def result(self) -> Generation:
        assert self.finish_reason is not None
        return Generation(
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
            finish_reason=self.finish_reason,
            start_version=self.start_version,
            fingerprints=tuple(sorted(self.fingerprints.items())),
        )


@dataclass
class Batch:
    """The resident sequences in cache row order, their KV cache, and the admitted ones
    waiting for their prefill. Row ``i`` holds its first ``rows[i].length - 1`` tokens in the
    last columns of the cache's window; its last sampled token is the next decode's input."""

    cache: SlotCache
    rows: list[Request] = field(default_factory=list)
    version: int = -1  # the weights that filled the cache
    joining: list[Request] = field(default_factory=list)
    stopped: list[Request] = field(default_factory=list)  # finished, not handed out yet

    @property
    def decoding(self) -> bool:
        return any(not r.finished for r in self.rows)

    @property
    def active(self) -> int:
        return sum(not r.finished for r in self.rows) + len(self.joining)
