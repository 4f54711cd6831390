"""The trainer computes the LM head and the log-softmax only at trained positions
(``logits_to_keep``): the log-probs, the loss and the gradients are those of computing every
position's logits, with shared prefixes and without, on the tests' tiny model and on a small
Llama whose 8k vocabulary makes the head matter; and the head sees the trained rows alone."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TINY_MODEL, group_prefixes, make_groups
from transformers import LlamaConfig, LlamaForCausalLM

from orchestrator.algo.base import LossInputs
from orchestrator.algo.grpo import GRPO
from orchestrator.models.policy import Policy, keeps_logits, tiny_policy
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.trainer import TorchTrainer, logprobs, token_batch
from orchestrator.trainer.batch import TokenBatch

TEMPERATURE = 0.7
TIGHT = {"atol": 1e-6, "rtol": 1e-6}


class FullLogits(torch.nn.Module):
    """A model whose forward takes no ``logits_to_keep``: it computes every position's logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, **inputs: Any) -> Any:
        return self.inner(**inputs)


@pytest.fixture(params=["unshared", "two_passes", "packed"])
def share(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether groups share their prefix, and how: in two passes (the prefixes, then each
    row's own tokens) or packed into one row, a block per group; each layout whatever its cost."""
    if request.param != "unshared":
        monkeypatch.setattr(logprobs, "packing_pays", lambda *_: request.param == "packed")
    return request.param != "unshared"


def tiny_model(seed: int) -> torch.nn.Module:
    return tiny_policy(**{k: v for k, v in TINY_MODEL.items() if k != "_target_"}, seed=seed).model


def large_vocab_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(torch.float32).eval()


MODELS: dict[str, Callable[[int], torch.nn.Module]] = {"tiny": tiny_model,
                                                       "llama_8k_vocab": large_vocab_model}


def batch_for(vocab: int, seed: int = 0) -> TokenBatch:
    """Three groups sharing prompts of different lengths; one sample has a second turn after
    an untrained observation; rows of different lengths (padding); varied advantages and
    behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    sequences, masks, group = [], [], []
    for index, (prompt_len, replies) in enumerate([(7, [3, 5, 1]), (4, [6, 2]), (9, [4, 4, 2])]):
        prompt = tokens(prompt_len)
        for i, n in enumerate(replies):
            seq, mask = prompt + tokens(n), [False] * prompt_len + [True] * n
            if i == 0:  # a second turn after an observation
                seq, mask = seq + tokens(3) + tokens(2), mask + [False] * 3 + [True] * 2
            sequences.append(seq)
            masks.append(mask)
            group.append(index)
    prefix = group_prefixes(sequences, masks, group)
    assert min(prefix) > 1
    behaviour = [[-float(torch.rand((), generator=g)) * 5 for _ in s] for s in sequences]
    advantages = [float(torch.randn((), generator=g)) for _ in sequences]
    return token_batch(sequences, masks, 0, behaviour=behaviour, advantages=advantages, group=group,
                       prefix=prefix)


def run(model: torch.nn.Module, batch: TokenBatch, share: bool, micro: int = 64
        ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Masked log-probs, the summed GRPO loss and every weight's gradient."""
    trainer = TorchTrainer(Policy(model, CharTokenizer(), torch.device("cpu")), GRPO(),
                           share_prefix=share, micro_batch_size=micro, temperature=TEMPERATURE)
    trainer.model.eval()
    num_tokens = float(batch.mask.sum())
    logps, loss = [], torch.zeros(())
    for mb in trainer._micro_batches(batch):
        logp, _ = trainer._logprobs(mb)
        out = GRPO().loss(LossInputs(logprobs=logp, proximal_logprobs=logp.detach() + 0.1,
                                     behaviour_logprobs=mb.behaviour_logprobs,
                                     advantages=mb.advantages, mask=mb.mask, num_tokens=num_tokens))
        out.loss.backward()
        logps.append(logp * mb.mask)
        loss = loss + out.loss.detach()
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    return torch.cat(logps), loss, grads


def reference_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Every position's logits and log-softmax, then the trained targets' log-probs."""
    with torch.no_grad():
        logits = model(input_ids=batch.inputs, attention_mask=batch.attention).logits
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, batch.targets[..., None]).squeeze(-1) * batch.mask


@pytest.mark.parametrize("name", MODELS)
def test_trained_positions_only_give_the_full_logits_results(name: str, share: bool) -> None:
    make = MODELS[name]
    batch = batch_for(make(0).config.vocab_size)
    assert keeps_logits(make(0)) and not keeps_logits(FullLogits(make(0)))
    full_logp, full_loss, full_grads = run(FullLogits(make(0)), batch, share)
    for micro in (64, 3):  # 3: cuts groups in two
        logp, loss, grads = run(make(0), batch, share, micro)
        torch.testing.assert_close(logp, full_logp, **TIGHT)
        torch.testing.assert_close(loss, full_loss, **TIGHT)
        assert len(grads) == len(full_grads)
        for g, full in zip(grads, full_grads, strict=True):
            torch.testing.assert_close(g, full, **TIGHT)
    assert full_loss != 0 and all(g.abs().sum() > 0 for g in full_grads)
    # And both are what every position's log-softmax gives (shared prefixes: other kernels).
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if share else TIGHT
    torch.testing.assert_close(full_logp, reference_logprobs(make(0), batch), **tolerance)


def test_the_head_computes_the_trained_positions_alone(share: bool) -> None:
    model = large_vocab_model(0)
    batch = batch_for(model.config.vocab_size)
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: rows.append(args[0].shape[:-1].numel()))
    run(model, batch, share)
    trained = int(batch.mask.sum())
    if share:  # the head runs once per group at its last prefix position, which predicts
        # the first own token of each of the group's samples (trained here)
        groups, samples = len(set(batch.group.tolist())), len(batch)
        assert batch.mask[torch.arange(samples), batch.prefix - 1].all()
        assert sum(rows) == trained - samples + groups
    else:
        assert sum(rows) == trained
    assert sum(rows) < 0.5 * batch.attention.sum()


def test_lora_trains_at_trained_positions_with_the_full_logits_gradients(share: bool) -> None:
    batch = batch_for(8192)
    lora = {"r": 4, "alpha": 8}

    def adapters(model: torch.nn.Module) -> list[torch.Tensor]:
        trainer = TorchTrainer(Policy(model, CharTokenizer(), torch.device("cpu")), GRPO(),
                               lora=lora, temperature=TEMPERATURE, share_prefix=share)
        assert keeps_logits(trainer.model) == isinstance(model, LlamaForCausalLM)  # through peft
        trainer.model.eval()
        for p in trainer.model.parameters():  # B = 0 at first: give the adapters a value
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(p.numel()))
        logp, _ = trainer._logprobs(batch)
        (logp * batch.mask * batch.advantages).sum().backward()
        return [p.grad for p in trainer.model.parameters() if p.requires_grad]

    kept, full = adapters(large_vocab_model(0)), adapters(FullLogits(large_vocab_model(0)))
    assert kept and len(kept) == len(full)
    for g, f in zip(kept, full, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, f, **TIGHT)


def test_the_supervised_update_scores_the_trained_tokens_alone() -> None:
    batch_ids = [[5, 9, 11, 40, 41, 42], [5, 9, 12, 50, 51]]
    masks = [[False, False, False, True, True, True], [False, False, False, False, True]]
    losses, steps = [], []
    for model in (large_vocab_model(0), FullLogits(large_vocab_model(0))):
        trainer = TorchTrainer(Policy(model, CharTokenizer(), torch.device("cpu")), GRPO(),
                               max_grad_norm=1e9)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        losses.append(trainer.supervised_update(batch_ids, masks, optimizer))
        steps.append([b - p.detach() for b, p in zip(before, trainer.model.parameters())])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    batch = token_batch(batch_ids, masks, 0)  # every position's cross-entropy, the trained ones kept
    with torch.no_grad():
        logits = large_vocab_model(0)(input_ids=batch.inputs, attention_mask=batch.attention).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                                            reduction="none")
    assert losses[0] == pytest.approx(float((nll * batch.mask.flatten()).sum() / 4), rel=1e-6)
    for a, b in zip(*steps, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


def test_the_engine_gap_keeps_a_nan_in_its_max() -> None:
    """An engine gone wrong (NaN log-probs) shows in engine/logprob_diff_max, not only the mean."""
    from types import SimpleNamespace

    from orchestrator.trainer.logprobs import LogprobAgreement

    agreement = LogprobAgreement()
    ones = torch.ones(1, 3)
    agreement.add(torch.zeros(1, 3), SimpleNamespace(on_policy=ones, behaviour_logprobs=ones * 0.5))
    agreement.add(torch.zeros(1, 3), SimpleNamespace(
        on_policy=ones, behaviour_logprobs=torch.tensor([[0.1, float("nan"), 0.2]])))
    agreement.add(torch.zeros(1, 3), SimpleNamespace(on_policy=ones, behaviour_logprobs=ones * 2.0))
    metrics = agreement.metrics(warn_above=10.0)
    assert math.isnan(metrics["engine/logprob_diff_max"])


def test_the_passes_read_nothing_back_from_the_device(share: bool) -> None:
    """Every index and mask of a layout is found on the host and copied: on the ``meta``
    device, which holds no values, an op whose result depends on the device's values
    (``unique``, ``nonzero``, a boolean index: each a wait for the GPU on CUDA) fails. The
    forward and the backward run there whole. (transformers' own slicing by a boolean
    ``logits_to_keep`` is such an index, one per forward; it is turned off here.)"""
    policy = tiny_policy(**{k: v for k, v in TINY_MODEL.items() if k != "_target_"}, seed=0)
    trainer = TorchTrainer(policy, GRPO(), share_prefix=share)
    batch = trainer._batch_of(make_groups())
    assert batch is not None and int(batch.prefix.max()) > 1  # the groups share prompts
    trainer.model.to("meta")
    trainer.device = trainer.forward.device = torch.device("meta")
    trainer.forward.keeps_logits = False
    logp, entropy = trainer._logprobs(batch, entropy_grad=True)
    (logp.sum() + entropy.sum()).backward()
    assert logp.device.type == "meta" and logp.shape == batch.mask.shape
    assert all(p.grad is not None and p.grad.device.type == "meta"
               for p in trainer.model.parameters() if p.requires_grad)
