"""A decoder's matrix products: their shapes, the FLOPs they cost per token, and a matmul
microbenchmark of those shapes on this machine (``bench.peers``, ``bench.real_model``).

FLOPs of a forward pass over ``t`` tokens: ``2 x N x t`` for the matrix products, where ``N``
counts the weights of every matrix multiply (each layer's q, k, v, o, gate, up and down, and
the LM head; not the embedding lookup, which is a gather), plus attention: ``QK^T`` and
``AV`` cost ``2 x width`` each per (query token, key) pair, ``width`` the query heads times
the head size (grouped-query attention shares keys and values, not these products). A
backward pass costs twice its forward. The LM head may run at fewer positions than the
layers (the trainer computes it only where a token is trained): ``head_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def best_seconds(fn: Callable[[], Any], min_time: float = 0.03, repeats: int = 5,
                 calls: int = 3) -> float:
    """Best mean time of one call of ``fn`` over ``repeats`` rounds of at least ``min_time``
    and ``calls`` calls, after ``calls`` calls to warm up (the best: other processes on a
    shared machine only ever slow it down)."""
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        done, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < min_time or done < calls:
            fn()
            done += 1
        best = min(best, elapsed / done)
    return best


def linear_seconds(rows: int, fan_in: int, fan_out: int, backward: bool, **timing: Any) -> float:
    """One linear layer's forward on ``rows`` tokens, plus its two backward products
    (``timing``: :func:`best_seconds`' rounds)."""
    x, w, dy = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(rows, fan_out)
    seconds = best_seconds(lambda: torch.nn.functional.linear(x, w), **timing)
    if backward:
        seconds += (best_seconds(lambda: dy @ w, **timing)
                    + best_seconds(lambda: dy.t() @ x, **timing))
    return seconds


@dataclass(frozen=True)
class Shapes:
    """The ``(in, out)`` of every matrix multiply of a Llama-style decoder."""

    layer: tuple[tuple[int, int], ...]  # one layer's: q, k, v, o, gate, up, down
    layers: int
    head: tuple[int, int]  # the LM head
    width: int  # query heads x head size

    @classmethod
    def llama(cls, hidden: int, intermediate: int, layers: int, vocab: int,
              heads: int = 1, kv_heads: int | None = None, head_dim: int | None = None) -> Shapes:
        head_dim = head_dim or hidden // heads
        q, kv = heads * head_dim, (kv_heads or heads) * head_dim
        layer = ((hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
                 (hidden, intermediate), (hidden, intermediate), (intermediate, hidden))
        return cls(layer, layers, (hidden, vocab), q)

    @classmethod
    def of(cls, config: Any) -> Shapes:
        """From a ``transformers`` Llama-style config."""
        heads = int(config.num_attention_heads)
        return cls.llama(int(config.hidden_size), int(config.intermediate_size),
                         int(config.num_hidden_layers), int(config.vocab_size), heads,
                         int(getattr(config, "num_key_value_heads", None) or heads),
                         getattr(config, "head_dim", None))

    @property
    def weights(self) -> int:
        """``N``: the weights of every matrix multiply, the LM head's included."""
        return self.layers * sum(i * o for i, o in self.layer) + self.head[0] * self.head[1]

    def forward_flops(self, tokens: float, pairs: float, head_tokens: float | None = None) -> float:
        """A forward pass over ``tokens`` tokens whose queries attend to ``pairs`` keys in all
        (a causal pass over one sequence of ``n``: ``n (n + 1) / 2``), with the LM head at
        ``head_tokens`` of them (default: all)."""
        head = self.head[0] * self.head[1]
        head_tokens = tokens if head_tokens is None else head_tokens
        return (2 * (self.weights - head) * tokens + 2 * head * head_tokens
                + 4 * self.layers * self.width * pairs)

    def linear_time(self, rows: int, backward: bool, **timing: Any) -> float:
        """Seconds of every matrix multiply of a pass over ``rows`` tokens (each shape timed
        once at ``rows`` rows: the microbenchmark), forward, or forward and backward."""
        shapes = [*(s for s in self.layer for _ in range(self.layers)), self.head]
        return sum(linear_seconds(rows, i, o, backward, **timing) * shapes.count((i, o))
                   for i, o in set(shapes))
