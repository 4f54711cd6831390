"""Per-token log-probs of a batch's trained targets under a model, whatever layout computes
them: :class:`TokenLogprobs`, which the torch trainer runs for the policy, the proximal pass and
the reference policy alike; and :class:`LogprobAgreement`, how far the engine's log-probs are
from the trainer's on the same weights.

The LM head and the log-softmax over the vocabulary run only at the positions whose target
is trained (``TokenBatch.mask``; the loss, the entropy metric and the log-prob agreement use
no others), through ``transformers``' ``logits_to_keep``: prompt positions, observations and
padding go through the decoder layers only. A model whose forward takes no ``logits_to_keep``
computes every position's logits and the trainer keeps the trained ones (same results).

The samples of a group share their prompt, which ``share_prefix`` computes once: the groups
packed into one row, a block each (:mod:`~orchestrator.trainer.packing`), where that computes
fewer FLOPs, else in two passes (the prompts, then every sample's own tokens on top of their
cache).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch

from orchestrator.models.policy import PASSTHROUGH_MASK, cache_argument, keeps_logits
from orchestrator.trainer.batch import TokenBatch
from orchestrator.trainer.packing import attending_by_group, pack_by_group, packing_pays
from orchestrator.trainer.precision import Precision

log = logging.getLogger(__name__)


def _placed(keep: torch.Tensor, values: torch.Tensor,
            into: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` (one per True of ``keep``, a host mask, in row order) at their places in
    ``into`` (default: zeros) shaped like ``keep``, differentiably. By positions found on the
    host: a mask on the device (``masked_scatter``) makes its backward wait for the GPU to
    count the mask (``masked_select``)."""
    at = keep.flatten().nonzero().squeeze(1).to(values.device, non_blocking=True)
    base = values.new_zeros(keep.numel()) if into is None else into.flatten()
    return base.index_put((at,), values).view(keep.shape)


class TokenLogprobs:
    """The forward passes of a train step for one policy model (``model``: what the optimiser
    steps, after LoRA and sharding), on ``device`` in ``precision``, the logits divided by the
    sampling ``temperature`` as the engine's were; ``share_prefix``: a group's shared prompt
    computed once (packed or in two passes); ``autocasts``: whether the forward runs under the
    precision's autocast (not under FSDP2's mixed precision, which casts itself)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: Precision,
                 temperature: float, share_prefix: bool, autocasts: bool = True) -> None:
        self.model = model
        self.device = device
        self.precision = precision
        self.temperature = temperature
        self.share_prefix = share_prefix
        self.autocasts = autocasts
        self.keeps_logits = keeps_logits(model)
        # Groups pack into one row through transformers' attention interface.
        self.packs = isinstance(getattr(model.config, "_attn_implementation", None), str)
        self.cache_argument = cache_argument(model)
        self._flops_cache: tuple[float, float] | None = None

    def on(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, copied without waiting for the GPU."""
        return t.to(self.device, non_blocking=True)

    def logprobs(self, batch: TokenBatch, model: torch.nn.Module,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the targets and the entropy at each trained position
        (``[rows, width]``, zero where no target is trained) under ``model`` (the policy, or
        the reference policy), whatever layout computes them."""
        if self.share_prefix and int(batch.prefix.max()) > 1:
            return self._shared_prefix_logprobs(batch, model, entropy_grad)
        keep = batch.mask > 0
        logits, _ = self.logits(model, keep, input_ids=self.on(batch.inputs),
                                 attention_mask=self.on(batch.attention))
        logp, entropy = self._score(logits, self.on(batch.targets[keep]),
                                    entropy_grad=entropy_grad)
        return _placed(keep, logp), _placed(keep, entropy)

    def logits(self, model: torch.nn.Module, keep: torch.Tensor,
                **inputs: Any) -> tuple[torch.Tensor, Any]:
        """``model``'s logits at the positions ``keep`` (bool, ``[rows, width]``) marks, in row
        order (``[kept, vocab]``), and its output (its cache)."""
        with self.precision.autocast(self.device) if self.autocasts else nullcontext():
            if self.keeps_logits:
                out = model(**inputs, logits_to_keep=self.on(keep))
                return out.logits, out
            out = model(**inputs)
        if keep.device.type == "cpu":  # found on the host: indexing does not wait for the GPU
            return out.logits.flatten(0, 1)[self.on(keep.flatten().nonzero().squeeze(1))], out
        return out.logits[keep], out

    def _score(self, logits: torch.Tensor, targets: torch.Tensor,
               rows: torch.Tensor | None = None,
               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target's log-prob and the entropy of its distribution (differentiable with
        ``entropy_grad``); ``rows``: the row of ``logits`` each target reads (default: one row
        per target, in order)."""
        scaled = logits.float() if self.temperature == 1 else logits.float() / self.temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        if rows is None:
            return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy
        return logp_all[rows, targets], entropy[rows]

    @property
    def _flops(self) -> tuple[float, float]:
        """What a token and an attention pair cost the decoder layers (:func:`packing_pays`):
        ``2 x`` the weights outside the embeddings, ``4 x heads x head size x layers``."""
        if self._flops_cache is None:
            output = getattr(self.model, "get_output_embeddings", lambda: None)()
            tables = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Embedding)]
            tables += [output.weight] if isinstance(output, torch.nn.Module) else []
            embeddings = {id(t): t.numel() for t in tables}  # a tied LM head counts once
            weights = sum(p.numel() for p in self.model.parameters()) - sum(embeddings.values())
            config = self.model.config
            heads = getattr(config, "num_attention_heads", 0)
            head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(heads, 1)
            self._flops_cache = (2.0 * weights,
                                 4.0 * heads * head_dim * getattr(config, "num_hidden_layers", 0))
        return self._flops_cache

    @property
    def _dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())

    def _shared_prefix_logprobs(self, batch: TokenBatch, model: torch.nn.Module,
                                entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`logprobs` with each group's shared prefix run once, not once per sample:
        the groups packed into one row, a block each, where that computes less
        (:mod:`~orchestrator.trainer.packing`), else in two passes."""
        lengths = batch.attention.sum(1).tolist()
        group, prefix = batch.group.tolist(), batch.prefix.tolist()
        token_flops, pair_flops = self._flops
        if self.packs and packing_pays(lengths, group, prefix, token_flops, pair_flops):
            return self._packed_logprobs(batch, lengths, group, prefix, model, entropy_grad)
        return self._two_pass_logprobs(batch, model, entropy_grad)

    def _packed_logprobs(self, batch: TokenBatch, lengths: list[int], group: list[int],
                         prefix: list[int], model: torch.nn.Module,
                         entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group in one row, each a block of its prefix then its samples' own tokens,
        attending within its block and kept apart by its mask
        (:func:`~orchestrator.trainer.packing.pack_by_group`)."""
        dev = self.device
        trained = batch.mask > 0
        packing = pack_by_group(batch.inputs, lengths, trained, group, prefix)
        with attending_by_group(model) as inner:
            logits, _ = self.logits(
                model, packing.keep, input_ids=self.on(packing.input_ids),
                position_ids=self.on(packing.position_ids), use_cache=False,
                attention_mask=self.on(PASSTHROUGH_MASK),
                group_blocks=packing.blocks(self._dtype, dev, inner),
            )
        logp, entropy = self._score(logits, self.on(batch.targets[trained]), self.on(packing.rows),
                                    entropy_grad)
        return _placed(trained, logp), _placed(trained, entropy)

    def _two_pass_logprobs(self, batch: TokenBatch, model: torch.nn.Module,
                           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefixes in one pass, then every row's own tokens on top of their keys and values.

        The prefixes go through the model once (batch ``[groups, longest prefix]``, right
        padded); their keys and values, still in the autograd graph, are repeated for each
        row, and the rows' own tokens run on top of them at their true positions. The last
        prefix position predicts every row's first own token: the prefix pass computes the
        LM head there alone, the rows' pass at their trained positions. With a group of 4
        sharing a 10-token prompt before ~5 tokens each, the trainer computes 30 positions
        instead of 60.
        """
        # Every index and mask is found on the host, from the batch's own copy, and copied
        # once: on the device, unique(), boolean indexing and the shapes they give would each
        # make the host wait for the GPU.
        groups, row_group = torch.unique(batch.group, return_inverse=True)
        first_row = torch.full((len(groups),), len(batch), dtype=torch.long)
        first_row.scatter_reduce_(0, row_group, torch.arange(len(batch)), "amin")
        group_prefix = batch.prefix[first_row].clamp(min=1)  # a row with none shares its first token
        prefix = group_prefix[row_group]
        longest = int(group_prefix.max())
        columns = torch.arange(longest)
        prefix_attention = (columns < group_prefix[:, None]).long()
        last = columns == group_prefix[:, None] - 1  # predicts each row's token `prefix`
        head_logits, head = self.logits(model, last,
                                         input_ids=self.on(batch.inputs[first_row, :longest]),
                                         attention_mask=self.on(prefix_attention), use_cache=True)
        cache = getattr(head, self.cache_argument)
        on_rows = self.on(row_group)
        for layer in cache.layers:  # each row sees its group's prefix (gradients flow back)
            layer.keys = layer.keys.index_select(0, on_rows)
            layer.values = layer.values.index_select(0, on_rows)

        # Trained target positions: the last prefix one (from the prefix pass), then the rows'.
        full = batch.inputs.shape[1]
        trained = batch.mask > 0
        position = torch.arange(full)
        first = trained & (position == prefix[:, None] - 1)
        rest = trained & (position >= prefix[:, None])
        logp, entropy = self._score(head_logits[self.on(row_group[first.any(1)])],
                                    self.on(batch.targets[first]), entropy_grad=entropy_grad)
        logp_full, entropy_full = _placed(first, logp), _placed(first, entropy)

        own = batch.attention.sum(1) - prefix  # each row's inputs after its prefix
        width = int(own.max())
        if width > 0:
            offsets = torch.arange(width)
            positions = prefix[:, None] + offsets
            valid = offsets < own[:, None]
            at = positions.clamp(max=full - 1)
            logits, _ = self.logits(
                model, valid & rest.gather(1, at),
                input_ids=self.on(batch.inputs.gather(1, at)),
                attention_mask=self.on(torch.cat([prefix_attention[row_group], valid.long()], dim=1)),
                position_ids=self.on(positions),
                **{self.cache_argument: cache},
            )
            logp, entropy = self._score(logits, self.on(batch.targets[rest]),
                                        entropy_grad=entropy_grad)
            logp_full = _placed(rest, logp, into=logp_full)
            entropy_full = _placed(rest, entropy, into=entropy_full)
        return logp_full, entropy_full


class LogprobAgreement:
    """How far the engine's behaviour log-probs are from the trainer's, on the same weights.

    Tokens sampled by the weights the trainer holds at the start of a step (their version is
    the trainer's) must get the same log-prob from both; a gap means the engine and trainer
    disagree (dtype, kernels, a tokenisation or weight-sync bug) and makes every importance
    ratio wrong. Reported as ``engine/logprob_diff`` (mean absolute difference) and
    ``engine/logprob_diff_max``; a mean above ``trainer.logprob_diff_warn`` is logged.
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0.0
        self.max = 0.0
        self._parts: list[torch.Tensor] = []  # per add: (sum, count, max) on the device

    def add(self, trainer_logprobs: torch.Tensor, batch: TokenBatch) -> None:
        """Kept on the device; read once, by :meth:`settle`."""
        device = trainer_logprobs.device
        on_policy = batch.on_policy.to(device, non_blocking=True)
        behaviour = batch.behaviour_logprobs.to(device, non_blocking=True)
        gap = (trainer_logprobs.detach() - behaviour).abs() * on_policy
        if gap.numel():
            self._parts.append(torch.stack([gap.sum(), on_policy.sum(), gap.max()]).double())

    def settle(self) -> LogprobAgreement:
        """The sums and the maximum as numbers (one wait for the device)."""
        if self._parts:
            parts = torch.stack(self._parts).cpu()
            self._parts = []
            self.total += float(parts[:, 0].sum())
            self.count += float(parts[:, 1].sum())
            worst = float(parts[:, 2].max()) if not parts[:, 2].isnan().any() else math.nan
            if not math.isnan(self.max) and (math.isnan(worst) or worst > self.max):
                self.max = worst  # a NaN (an engine gone wrong) stays: max() would skip it
        return self

    def metrics(self, warn_above: float) -> dict[str, float]:
        self.settle()
        if not self.count:
            return {}
        mean = self.total / self.count
        if mean > warn_above or math.isnan(mean):
            log.warning("engine and trainer log-probs differ by %.3g on average on the same "
                        "weights (trainer.logprob_diff_warn=%g): check dtypes and weight sync",
                        mean, warn_above)
        return {"engine/logprob_diff": mean, "engine/logprob_diff_max": self.max}
