"""The torch trainer: one optimiser step per batch of groups, and the weights it hands to engines.

:meth:`TorchTrainer.step` awaits the blocking torch work in a worker thread, so the event
loop stays free. :meth:`TorchTrainer.weights` hands out the model's own tensors by reference
(no copy); the next step waits until the engines have released them (see
:mod:`orchestrator.weights.update`). The version counts optimiser steps: a batch trained at
version ``v`` produces version ``v + 1``.

Per step: the algorithm's advantages from each group's rewards (``algo``; GRPO's group
normalisation by default), then ``num_minibatches`` optimiser updates over the batch. With a
single update the proximal policy is the current one (its log-probs are the detached forward
pass); with several it is recomputed once, up front. Each update accumulates gradients over
micro-batches, normalised by the trained tokens of the whole minibatch so token-level
aggregation does not depend on how it is split.

The batch a step works on is :mod:`~orchestrator.trainer.batch`'s (every per-token field by
name, the proximal and reference log-probs included); the forward passes that give its
log-probs, whatever the layout (trained positions only, a group's prompt once),
:mod:`~orchestrator.trainer.logprobs`'s.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import torch

from orchestrator.algo.base import Algorithm, LossInputs
from orchestrator.errors import ConfigError
from orchestrator.faults import kill_point
from orchestrator.models.policy import Policy
from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.trainer.batch import TokenBatch, generation_cap, shared_prefix, token_batch
from orchestrator.trainer.logprobs import LogprobAgreement, TokenLogprobs
from orchestrator.trainer.lora import LoraConfig, adapter_update
from orchestrator.trainer.precision import Precision
from orchestrator.trainer.snapshot import SHARDS, TrainerSnapshot, load_shards
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # torch's fused AdamW kernels
PER_SEQUENCE = "per_sequence:"  # a step's sums weighted by sequences, not tokens

log = logging.getLogger(__name__)


def _numbers(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Sums kept on the device, as numbers: one copy to the host for all of them."""
    tensors = [torch.as_tensor(v).detach().double() for v in values.values()]
    if not tensors:
        return {}
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    return dict(zip(values, torch.stack([t.to(device) for t in tensors]).tolist(), strict=True))


def adamw(params: Iterable[torch.nn.Parameter], **options: Any) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel for the parameters (float, on CPU or CUDA): one
    pass over each tensor instead of a dozen element-wise ones (docs/real-model.md has what
    it saves). The result differs from the unfused one's by rounding only."""
    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES
                                 for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **options)


class TorchTrainer(Trainer):
    """The trainer of ``trainer=torch`` (every launcher's, one process or a rank each): the
    policy's model, its AdamW optimiser and the :class:`~orchestrator.algo.base.Algorithm`
    whose advantages and loss a step applies; the warm start, the reference policy (for a KL
    term) and checkpoints too. Arguments are ``conf/trainer``'s keys (docs/configuration.md);
    a bad value is a :class:`~orchestrator.errors.ConfigError` naming it."""

    trains_in_ranks = True  # trainer.world_size: FSDP2 ranks (orchestrator/trainer/distributed.py)

    def __init__(
        self,
        policy: Policy,
        algorithm: Algorithm,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 64,
        num_minibatches: int = 1,
        warmup_steps: int = 0,
        temperature: float = 1.0,
        logprob_diff_warn: float = 0.05,
        share_prefix: bool = True,
        lora: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        precision: str = "auto",
    ) -> None:
        if micro_batch_size < 1:
            raise ConfigError(f"trainer.micro_batch_size must be >= 1, got {micro_batch_size}")
        if num_minibatches < 1:
            raise ConfigError(f"trainer.num_minibatches must be >= 1, got {num_minibatches}")
        if lr <= 0:
            raise ConfigError(f"trainer.lr must be > 0, got {lr}")
        if warmup_steps < 0:
            raise ConfigError(f"trainer.warmup_steps must be >= 0, got {warmup_steps}")
        if world_size is not None:  # ranks are placed by the launcher, not built here
            raise ConfigError(f"trainer.world_size={world_size} needs the launcher to place the "
                              f"ranks: launcher=local or launcher=ray builds them from it")
        self.policy = policy
        self.model = policy.model
        self.algorithm = algorithm
        self.device = policy.device
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.num_minibatches = num_minibatches
        self.temperature = temperature if temperature > 0 else 1.0
        self.logprob_diff_warn = logprob_diff_warn
        self.share_prefix = share_prefix
        loaded = next(p.dtype for p in policy.model.parameters() if p.is_floating_point())
        self.precision = Precision.resolve(precision, self.device, loaded)
        if loaded != self.precision.weights:  # e.g. fp32 master weights of a bf16 checkpoint
            policy.model.to(self.precision.weights)
        # Updates travel in the engines' dtype (they load model.dtype) where that is smaller:
        # a mixed trainer's float32 master weights of a bf16 model, as bf16.
        self._wire_dtype = (loaded if loaded.itemsize < self.precision.weights.itemsize
                            else None)
        self._autocasts = True  # a rank under FSDP2's mixed precision does not (its _prepare)
        self.lora = LoraConfig.of(lora)
        if self.lora is not None:  # only the adapters train (orchestrator.trainer.lora)
            self.model = self.lora.wrap(self.model)
        # The reference policy (a KL term): a frozen copy, sharded like the policy.
        reference = self._reference_copy(self.model)
        self.model = self._prepare(self.model)
        self._reference_model = None if reference is None else self._prepare_reference(reference)
        self._reference_started = False
        # the forward passes: the policy's, the proximal pass and the reference policy's
        self.forward = TokenLogprobs(self.model, self.device, self.precision, self.temperature,
                                     share_prefix, self._autocasts)
        # The parameters as the optimisers must hold them: under trainer ranks, FSDP2's sharded
        # ones (while gathered, model.parameters() gives temporary unsharded tensors, and an
        # optimiser built from those would step nothing that lasts).
        self._parameters = list(self.model.parameters())
        self.optimizer = adamw([p for p in self._parameters if p.requires_grad], lr=lr,
                               weight_decay=weight_decay, betas=tuple(betas))
        # Linear warm-up: Adam's first updates are sign-like and RL gradients are noisy.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / max(warmup_steps, 1))
        )
        self.version = 0
        self._published: WeightUpdate | None = None  # by reference, until the engines release it
        self._fingerprinting: WeightUpdate | None = None  # its fingerprint still being computed
        self._fingerprinter: ThreadPoolExecutor | None = None  # the thread computing it
        self._warm_optimizer: torch.optim.Optimizer | None = None
        self._base_sent = False  # LoRA: the engines have the base weights

    # -- forward ---------------------------------------------------------------------

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the trainer's device, copied without waiting for the GPU."""
        return self.forward.on(t)

    def _logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the targets and the entropies (:class:`TokenLogprobs`) under
        ``model`` (default: the policy)."""
        return self.forward.logprobs(batch, self.model if model is None else model, entropy_grad)

    def _micro_batches(self, batch: TokenBatch) -> list[TokenBatch]:
        size = self.micro_batch_size
        return [batch.slice(slice(i, i + size)) for i in range(0, len(batch), size)]

    # -- RL step -----------------------------------------------------------------------

    async def step(self, groups: Sequence[Group]) -> TrainStats:
        await self._engines_done()
        return await anyio.to_thread.run_sync(self.train_step, groups)

    async def _engines_done(self) -> None:
        """Wait until the engines have read the weights handed out by reference."""
        if self._published is not None:
            await self._published.wait_released()
            self._published = None

    def train_step(self, groups: Sequence[Group]) -> TrainStats:
        """The blocking RL step over ``groups`` (:meth:`step` runs it in a worker thread).

        In order: the batch packed into rows (this rank's share of the groups under ranks);
        the log-probs the algorithm needs before any update (the proximal policy's with
        several updates, the reference policy's for a KL term); the advantages, from the
        rewards (less a KL penalty in the reward) and put on the rows; then
        ``num_minibatches`` updates, each accumulating gradients over micro-batches and
        clipping their norm before the optimiser step; the version moves by one. Returns the
        step's metrics (loss, clip and correction fractions, entropy, the engine/trainer
        log-prob agreement, gradient norm)."""
        # The warm start is over: its AdamW's state (8 bytes a parameter) would stay on the
        # device for the whole run, beside the RL optimiser's, with nothing to use it.
        self._warm_optimizer = None
        algorithm = self.algorithm
        mine = self._share(groups)  # all of them here; a rank's part in a group of ranks
        batch = self._batch_of(groups, mine)
        # Eval mode (no dropout): the engine samples without it, and the importance weight and
        # the clip ratio compare log-probs that must be deterministic. Gradients still flow.
        self.model.eval()
        self._start_reference()
        agreement = LogprobAgreement()
        cap = generation_cap(groups)  # over every group: each rank's loss divides alike
        batch = self._before_updates(batch, agreement)
        advantages = algorithm.advantages(groups, self._penalties(groups, batch, cap))
        if batch is not None:
            batch = batch.with_advantages(*advantages.per_sample())

        sums: dict[str, Any] = {}  # tensors on the device until the step's end
        grad_norm = 0.0
        updated = False
        rows_total = len(batch) if batch is not None else 0
        size = math.ceil(rows_total / self.num_minibatches)
        for index in range(self.num_minibatches):
            start = index * size
            part = batch.slice(slice(start, start + size)) if batch is not None else None
            # The loss is normalised by the trained tokens (and sequences) of the whole
            # minibatch, over every rank: each rank's gradient is its share of the one the
            # whole batch gives.
            local_rows = len(part) if part is not None else 0
            total_rows, num_tokens, num_sequences = self._all_sum([
                local_rows, float(part.mask.sum()) if local_rows else 0.0,
                float((part.mask.sum(1) > 0).sum()) if local_rows else 0.0])
            if not total_rows:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            with self._accumulating():
                for mb in self._micro_batches(part) if local_rows else ():
                    logp, entropy = self._logprobs(mb, entropy_grad=algorithm.needs_entropy_grad)
                    if mb.proximal_logprobs is None and start == 0:
                        # before any update: the weights that sampled on-policy tokens
                        agreement.add(logp.detach(), mb)
                    inputs = self._loss_inputs(mb, logp, num_tokens, num_sequences, entropy, cap)
                    mask = inputs.mask
                    out = algorithm.loss(inputs)
                    out.loss.backward()
                    tokens = mask.sum()  # sums stay on the device until the step's end
                    sequences = (mask.sum(1) > 0).sum()
                    weighted = {"loss": out.loss.detach() * num_tokens,
                                **{k: v * tokens for k, v in out.metrics.items()},
                                **{PER_SEQUENCE + k: v * sequences
                                   for k, v in out.sequence_metrics.items()}}
                    weighted["entropy"] = (entropy.detach() * mask).sum()
                    weighted["trained_tokens"] = tokens
                    weighted["trained_sequences"] = sequences
                    for k, v in weighted.items():
                        sums[k] = sums.get(k, 0.0) + v
            grad_norm = self._clip_gradients()
            kill_point("train_step", self.version)
            self._weights_may_change()
            self.optimizer.step()
            updated = True
        if updated:  # the schedule counts updates: a step with nothing to train is none
            self.scheduler.step()
        self.version += 1
        sums = self._all_sum_named(_numbers(sums))
        counts = sums.pop("trained_tokens", 0.0)
        sequences = sums.pop("trained_sequences", 0.0)
        metrics = {k.removeprefix(PER_SEQUENCE): v / max(
            sequences if k.startswith(PER_SEQUENCE) else counts, 1.0) for k, v in sums.items()}
        metrics.update(advantages.metrics)
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["trained_tokens"] = float(counts)
        metrics["trained_sequences"] = float(sequences)
        metrics.update(self._agreement(agreement).metrics(self.logprob_diff_warn))
        return metrics

    def _loss_inputs(self, batch: TokenBatch, logprobs: torch.Tensor, num_tokens: float,
                     num_sequences: float = 0.0, entropy: torch.Tensor | None = None,
                     generation_cap: float | None = None) -> LossInputs:
        """The algorithm's inputs for these rows (the one place they are built): the batch's
        per-token fields on the device beside ``logprobs``. The proximal policy's log-probs are
        the batch's, computed before the first update, or where it has none ``logprobs``
        detached (one update a step: the current policy is the proximal one)."""
        proximal = batch.proximal_logprobs
        return LossInputs(
            logprobs=logprobs,
            proximal_logprobs=logprobs.detach() if proximal is None else proximal,
            behaviour_logprobs=self._on(batch.behaviour_logprobs),
            advantages=self._on(batch.advantages),
            mask=self._on(batch.mask),
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            reference_logprobs=batch.reference_logprobs,
            entropy=entropy,
            generation_cap=generation_cap,
        )

    def _before_updates(self, batch: TokenBatch | None,
                        agreement: LogprobAgreement) -> TokenBatch | None:
        """The batch with what must be computed before the first update, for every row (no
        gradients): the proximal log-probs when a step makes several updates (or the reward
        needs the current policy's), the reference policy's when the algorithm uses them."""
        algorithm = self.algorithm
        wants_proximal = (self.num_minibatches > 1 and algorithm.needs_proximal) or \
            algorithm.penalises_reward
        if self.num_minibatches > 1 or wants_proximal:
            self._full_weights()
        if batch is None:
            return None
        with torch.no_grad():
            if wants_proximal:
                proximal = torch.cat([self._logprobs(mb)[0] for mb in self._micro_batches(batch)])
                agreement.add(proximal, batch)
                batch = replace(batch, proximal_logprobs=proximal)
            if algorithm.needs_reference:
                with self._reference() as reference:
                    batch = replace(batch, reference_logprobs=torch.cat(
                        [self._logprobs(mb, reference)[0] for mb in self._micro_batches(batch)]))
        return batch

    def _penalties(self, groups: Sequence[Group], batch: TokenBatch | None,
                   cap: float | None) -> list[list[float]] | None:
        """Per sample of every group, what the algorithm subtracts from its reward (a KL
        penalty): each rank puts its rows' at their samples, and the ranks' are summed."""
        if not self.algorithm.penalises_reward:
            return None
        values = torch.zeros(sum(len(g) for g in groups), dtype=torch.float64)
        if batch is not None and batch.proximal_logprobs is not None:
            # before the advantages are set: the batch's are zeros, which a penalty does not read
            penalty = self.algorithm.reward_penalty(self._loss_inputs(
                batch, batch.proximal_logprobs, float(batch.mask.sum()), generation_cap=cap))
            if penalty is not None:
                values[batch.sample] = penalty.detach().to("cpu", torch.float64)
        values = self._all_sum_tensor(values)
        return [part.tolist() for part in values.split([len(g) for g in groups])]

    # -- the reference policy ---------------------------------------------------------------

    def _reference_copy(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """A frozen copy of ``model`` for the reference policy, if the algorithm needs one
        (under LoRA the base model is the reference: no copy)."""
        if not self.algorithm.needs_reference or self.lora is not None:
            return None
        reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        reference.eval()
        return reference

    def _start_reference(self) -> None:
        """At the first RL step (after any warm start), the reference takes the policy's
        weights; a resumed run has them from its checkpoint."""
        if self._reference_model is None or self._reference_started:
            return
        with torch.no_grad():
            for ref, param in zip(self._reference_model.parameters(), self._parameters,
                                  strict=True):
                ref.copy_(param.detach())
        self._reference_started = True

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy's model: the frozen copy, or under LoRA the policy with its
        adapters disabled."""
        if self._reference_model is not None:
            yield self._reference_model
        else:
            with self.model.disable_adapter():
                yield self.model

    def _batch_of(self, groups: Sequence[Group],
                  mine: Sequence[int] | None = None) -> TokenBatch | None:
        """The samples of the groups at ``mine`` (default: all), one per row, each knowing its
        index among all ``groups``' samples (their advantages are set later, by it)."""
        mine = range(len(groups)) if mine is None else mine
        starts = [0, *itertools.accumulate(len(g) for g in groups)]
        sample = [starts[g] + i for g in mine for i in range(len(groups[g]))]
        groups = [groups[g] for g in mine]
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            return None
        return token_batch(
            [t.token_ids for t in trajectories],
            [t.loss_mask for t in trajectories],
            self.policy.tokenizer.pad_id,
            behaviour=[t.logprobs for t in trajectories],
            on_policy=[[v == self.version for v in t.versions] for t in trajectories],
            group=[i for i, g in enumerate(groups) for _ in g.trajectories],
            prefix=[p for g in groups for p in [shared_prefix(
                [t.token_ids for t in g.trajectories], [t.loss_mask for t in g.trajectories]
            )] * len(g.trajectories)],
            sample=sample,
        )

    # -- what a rank of a group of ranks changes (orchestrator.trainer.distributed) -------

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the optimiser steps (a rank shards it here)."""
        return model

    def _share(self, groups: Sequence[Group]) -> list[int]:
        """The indices of the groups this process trains."""
        return self._share_sizes([sum(len(t.token_ids) for t in g.trajectories) for g in groups])

    def _share_sizes(self, sizes: Sequence[int]) -> list[int]:
        """The indices of the items (of these token counts) this process trains: all here."""
        return list(range(len(sizes)))

    def _all_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over the ranks (here: themselves)."""
        return self._all_sum_tensor(torch.tensor(list(values), dtype=torch.float64)).tolist()

    def _all_sum_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (on the CPU) summed over the ranks, elementwise (here: themselves)."""
        return values

    def _all_sum_named(self, values: Mapping[str, float]) -> dict[str, float]:
        return dict(values)

    def _agreement(self, agreement: LogprobAgreement) -> LogprobAgreement:
        return agreement

    def _full_weights(self) -> None:
        """Before forward passes outside :meth:`_accumulating` (a rank gathers its shards)."""

    def _prepare_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reference policy's frozen copy as this process holds it (a rank shards it)."""
        return model

    @contextmanager
    def _accumulating(self) -> Iterator[None]:
        """Around a minibatch's backward passes; a rank reduces the gradients on leaving."""
        yield

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))

    # -- supervised warm start ---------------------------------------------------------

    async def supervised_step(self, sequences: Sequence[Sequence[int]],
                              masks: Sequence[Sequence[bool]], lr: float) -> float:
        """A warm-start step with an AdamW of its own at ``lr`` (so the RL optimiser starts
        fresh), in a worker thread; does not change the version."""
        await self._engines_done()
        return await anyio.to_thread.run_sync(self.supervised_update, sequences, masks,
                                              self.warm_optimizer(lr))

    def warm_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The warm start's AdamW at ``lr`` (a new one when ``lr`` changes), over every weight:
        with LoRA too, the warm start trains the base weights (it stands for the pre-training a
        LoRA run starts from); RL trains the adapters only."""
        if self._warm_optimizer is None or self._warm_optimizer.param_groups[0]["lr"] != lr:
            # Unfused, as before: the warm start stops at the first greedy check that reaches
            # its target, so rounding-level differences move where it stops (the default
            # experiment's held-out accuracy after it: 0.315 unfused, 0.195 fused).
            self._warm_optimizer = torch.optim.AdamW(self._parameters, lr=lr,
                                                     weight_decay=0.0)
        return self._warm_optimizer

    def supervised_update(
        self,
        sequences: Sequence[Sequence[int]],
        masks: Sequence[Sequence[bool]],
        optimizer: torch.optim.Optimizer,
    ) -> float:
        """One cross-entropy step on the masked tokens with ``optimizer``."""
        frozen = [p for p in self._parameters if not p.requires_grad]
        for p in frozen:  # LoRA's base weights: trained by the warm start alone
            p.requires_grad_(True)
        try:
            return self._supervised_update(sequences, masks, optimizer)
        finally:
            for p in frozen:
                p.requires_grad_(False)
            if frozen:
                self._base_sent = False  # the engines need the new base weights

    def _supervised_update(
        self,
        sequences: Sequence[Sequence[int]],
        masks: Sequence[Sequence[bool]],
        optimizer: torch.optim.Optimizer,
    ) -> float:
        mine = self._share_sizes([len(seq) for seq in sequences])
        batch = token_batch([sequences[i] for i in mine], [masks[i] for i in mine],
                            self.policy.tokenizer.pad_id) if mine else None
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        _, num_tokens = self._all_sum([0.0, float(batch.mask.sum()) if batch is not None else 0.0])
        total = 0.0
        with self._accumulating():
            for mb in self._micro_batches(batch) if batch is not None else ():
                keep = mb.mask > 0  # the head runs at the trained tokens only
                logits, _ = self.forward.logits(self.model, keep,
                                                input_ids=self._on(mb.inputs),
                                                attention_mask=self._on(mb.attention))
                nll = torch.nn.functional.cross_entropy(
                    logits.float(), self._on(mb.targets[keep]), reduction="sum")
                loss = nll / max(num_tokens, 1.0)
                loss.backward()
                total += float(loss.detach())
        self._clip_gradients()
        self._weights_may_change()
        optimizer.step()
        return self._all_sum([total])[0]

    # -- weights -----------------------------------------------------------------------

    async def weights(self) -> WeightUpdate:
        """The model's tensors by reference; :meth:`step` waits for their release. With LoRA,
        copies of the adapters (the first time, with the base weights the engines start from).
        Either carries its fingerprint, computed on the trainer's device, if
        :attr:`fingerprints`, by a thread of its own while the update travels to the engines
        and the next step's forward and backward passes run (the optimiser step waits for it);
        at the default experiment's size that hides it from the step's time
        (docs/attestation.md)."""
        if self.lora is not None:
            update = adapter_update(self.version, self.model.state_dict(), self.lora.scale,
                                    with_base=not self._base_sent)
            self._base_sent = True
        else:
            update = self._published = WeightUpdate.by_reference(
                self.version, self.model.state_dict()).with_wire_dtype(self._wire_dtype)
        if self.fingerprints:
            # computed while the update travels and the next step's forward and backward run
            if self._fingerprinter is None:
                self._fingerprinter = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
            update = self._fingerprinting = update.attested_in(self._fingerprinter)
        return update

    def _weights_may_change(self) -> None:
        """Wait until the fingerprint of the last update published is computed: it reads the
        tensors an optimiser step or a load changes (called in a worker thread)."""
        if self._fingerprinting is not None:
            self._fingerprinting.wait_fingerprinted()
            self._fingerprinting = None

    # -- checkpoints ---------------------------------------------------------------------

    _last_snapshot: TrainerSnapshot | None = None  # written already: its memory is reused

    def snapshot(self) -> TrainerSnapshot:
        self._last_snapshot = TrainerSnapshot.capture(self.state_dict(), self.model,
                                                      self.policy.tokenizer, self._last_snapshot)
        return self._last_snapshot

    def load(self, directory: Path) -> None:
        if (Path(directory) / SHARDS).is_dir():  # a run of trainer ranks, resumed in one process
            load_shards(self, Path(directory))
        else:
            self.restore(TrainerSnapshot.read(Path(directory)))

    def restore(self, snapshot: TrainerSnapshot) -> None:
        """Load a snapshot (read from a checkpoint, or shipped to a trainer actor)."""
        self._weights_may_change()  # (before loading the weights; load_state_dict loads again)
        self.model.load_state_dict(snapshot.weights, strict=False)  # tied weights are saved once
        self.load_state_dict({**snapshot.owned_state(), "model": self.model.state_dict()})

    def state_dict(self) -> dict[str, Any]:
        state = {"version": self.version, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self._reference_model is not None and self._reference_started:
            state["reference"] = self._reference_model.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._weights_may_change()
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if self._reference_model is not None and "reference" in state:
            self._reference_model.load_state_dict(state["reference"])
            self._reference_started = True
        elif self._reference_model is not None and self.version > 0:
            log.warning("the checkpoint has no reference policy (it was trained without a KL "
                        "term): the reference is the policy at version %d", self.version)
