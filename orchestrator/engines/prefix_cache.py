"""The torch engine's prefix cache: a finished sequence's keys and values are parked; an
episode's next turn, which extends them with an observation, takes them back and only its new
tokens go through the model, in the next step with everyone else's, instead of prefilling the
whole conversation again.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence

import torch

from orchestrator.engines.torch_requests import Request
from orchestrator.types import FinishReason

HEAD = 8  # ids a parked sequence is found by


class PrefixCache:
    """Finished sequences' keys and values, kept for the next turn of their episode.

    A multi-turn episode's next request is its previous prompt and completion plus an
    observation. Without this, every turn prefills the whole conversation again. A finished
    sequence's cached keys and values (prompt + completion, less its last token, which never
    went through the model) are parked under those token ids, newest last; a request whose
    ids extend a parked sequence (of the same weights) takes it and only its new tokens go
    through the model, fed by the decode steps (one per step, in the running batch). Oldest
    entries go first past ``max_tokens`` parked tokens; a weight update drops them all (they
    were computed by the old weights); 0 turns it off.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.version = -1
        self.hits = 0  # requests that resumed a parked sequence
        self.reused = 0  # tokens they did not prefill again
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = \
            OrderedDict()
        # the parked keys by their first HEAD ids (a shorter key: by itself), so a request
        # looks at its own episode's, not at every parked sequence
        self._heads: defaultdict[tuple[int, ...], set[tuple[int, ...]]] = defaultdict(set)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def park(self, requests: Sequence[Request], kvs: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
             version: int) -> None:
        self._at(version)
        for request, kv in zip(requests, kvs, strict=True):
            if request.finish_reason is FinishReason.ABORTED or request.fed == 0:
                continue
            key = tuple((request.prompt_ids + request.token_ids)[: request.fed])
            if key in self._entries:
                self._remove(key)
            self._entries[key] = kv
            self._heads[key[:HEAD]].add(key)
            self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def take(self, request: Request, version: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The keys and values (per layer ``[heads, tokens, head_dim]``) of the longest parked
        sequence ``request`` extends (they leave the store: the request's row holds them
        now), or None."""
        self._at(version)
        extended = self.extended(request.prompt_ids + request.token_ids)
        if not extended:
            return None
        best = max(extended, key=len)
        self.hits += 1
        self.reused += len(best)
        return self._remove(best)

    def extended(self, ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The parked sequences that ``ids`` continue past their end."""
        candidates = (key for n in range(1, min(HEAD, len(ids)) + 1)
                      for key in self._heads.get(tuple(ids[:n]), ()))
        return [key for key in candidates if continues_prefix(ids, key)]

    def _remove(self, key: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.tokens -= len(key)
        bucket = self._heads[key[:HEAD]]
        bucket.discard(key)
        if not bucket:
            del self._heads[key[:HEAD]]
        return self._entries.pop(key)

    def _at(self, version: int) -> None:
        if version != self.version:  # computed by other weights: of no use now
            self._entries.clear()
            self._heads.clear()
            self.tokens, self.version = 0, version


def continues_prefix(ids: Sequence[int], key: tuple[int, ...]) -> bool:
    """Whether ``ids`` continue the sequence ``key`` past its end."""
    n = len(key)
    return n < len(ids) and ids[n - 1] == key[-1] and tuple(ids[:n]) == key
