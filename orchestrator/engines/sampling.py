"""How the torch engine draws a token: :func:`sample` at each row's temperature, after
:func:`truncate` (top-p, top-k).

A request whose ``SamplingParams.seed`` is set draws its uniform variates from a stream of its
own, seeded by it, so what it samples does not depend on which requests share its steps or in
what order they came (the pipeline seeds every sample:
:func:`~orchestrator.episodes.rollout.sample_seed`); the others share the engine's generator
(``engine.seed``).
"""

from __future__ import annotations

import torch


def truncate(logits: torch.Tensor, top_p: torch.Tensor | None = None,
             top_k: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` with every token outside each row's top-``k`` (``k = 0``: all) and outside
    its nucleus (the smallest set of likeliest tokens whose probability reaches ``top_p``;
    1: all) set to −inf. Ties at the edge of the top k are all kept."""
    if top_k is not None:
        vocab = logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = logits.topk(int(k.max()), -1).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = logits.sort(-1, descending=True)
        probs = torch.softmax(ordered.double(), -1)
        before = probs.cumsum(-1) - probs  # the mass of the likelier tokens
        drop = before >= top_p[:, None]  # the nucleus was full before this token
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator,
           uniform: bool | None = None, greedy: bool | None = None,
           variates: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
           top_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` at the row's ``temperature`` (0: greedy), and its
    log-probability. A draw inverts the row's cumulative distribution at a uniform variate,
    summed in float64 so that rounding cannot reach a token of probability 0; the
    log-probability is the token's logit less the log of that sum, in float64 too (closer to
    a float64 ``log_softmax`` than a float32 one is). Four passes over the vocabulary, where
    ``torch.multinomial`` draws an exponential variate per entry (docs/real-model.md has the
    figures). ``uniform`` (every temperature is 1) and ``greedy`` (some row is greedy), when
    the caller knows them, spare a wait for the device to find out. ``variates``: the uniform
    variates in [0, 1) (float64, ``[rows, 1]``), when the caller has drawn them (per-request
    seeds); else they are drawn from ``generator``. ``top_p`` / ``top_k`` (per row; None: off)
    truncate the temperature-scaled distribution (:func:`truncate`) before the draw, and the
    log-probability is then the token's under the truncated, renormalised distribution it was
    drawn from (what vLLM's ``processed_logprobs`` gives)."""
    if uniform is None:
        uniform = bool((temperature == 1).all())
    if greedy is None:
        greedy = bool((temperature <= 0).any())
    greedy_rows = temperature <= 0
    if not uniform:
        logits = logits / torch.where(greedy_rows, torch.ones_like(temperature), temperature)[:, None]
    if top_p is not None or top_k is not None:
        logits = truncate(logits, top_p, top_k)
    shifted = logits - logits.amax(-1, keepdim=True)
    cdf = torch.cumsum(shifted.exp(), -1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = (torch.rand((len(cdf), 1), generator=generator, dtype=cdf.dtype, device=cdf.device)
         if variates is None else variates)
    tokens = torch.searchsorted(cdf, u * total, right=True).squeeze(-1)
    tokens.clamp_(max=cdf.shape[-1] - 1)
    if greedy:
        tokens = torch.where(greedy_rows, shifted.argmax(-1), tokens)
    chosen = shifted.gather(-1, tokens[:, None]).double() - total.log()
    return tokens, chosen.squeeze(-1).to(logits.dtype)
