"""The torch trainer (orchestrator/trainer/): the batch a step works on, and RL steps on groups
the torch engine produced through the episode runner."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import anyio
import pytest
import torch
from helpers import engine_for, group_prefixes, make_groups, threads_held

from envs.arithmetic import ArithmeticSpec
from orchestrator.algo.grpo import GRPO
from orchestrator.config.schema import RolloutConfig
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer import TorchTrainer, token_batch
from orchestrator.trainer.batch import shared_prefix
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate

SPEC = ArithmeticSpec(digits=2, train_size=16, eval_size=4, seed=0)


def rollout_groups(policy: Any, num_groups: int = 2, group_size: int = 4,
                   max_tokens: int = 6, seed: int = 0) -> list[Group]:
    rollout = RolloutConfig(group_size=group_size, max_tokens=max_tokens, temperature=1.0)

    async def main() -> list[Group]:
        async with engine_for(policy, seed=seed) as engine:
            groups = []
            for task in SPEC.tasks("train")[:num_groups]:
                runner = EpisodeRunner(engine, policy.tokenizer, SPEC, rollout, Recorder())
                groups.append((await runner.group(task, "test")).group)
            return groups

    return anyio.run(main)


def with_rewards(group: Group, rewards: list[float]) -> Group:
    trajectories = tuple(dataclasses.replace(t, reward=r)
                         for t, r in zip(group.trajectories, rewards, strict=True))
    return dataclasses.replace(group, trajectories=trajectories)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    return [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]


# -- token_batch ----------------------------------------------------------------------------


def test_pack_aligns_targets_mask_and_behaviour_logprobs() -> None:
    batch = token_batch(
        sequences=[[1, 2, 3, 4], [5, 6]],
        masks=[[False, False, True, True], [False, True]],
        pad_id=0,
        behaviour=[[0.0, 0.0, -0.5, -0.6], [0.0, -0.7]],
        advantages=[1.5, -2.0],
    )
    assert batch.inputs.tolist() == [[1, 2, 3], [5, 6, 0]]
    assert batch.targets.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert batch.attention.tolist() == [[1, 1, 1], [1, 0, 0]]
    # position t predicts targets[t]; the mask and behaviour log-probs are those of targets[t]
    assert batch.mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert torch.allclose(batch.behaviour_logprobs, torch.tensor([[0.0, -0.5, -0.6], [-0.7, 0.0, 0.0]]))
    assert batch.advantages.tolist() == [[1.5, 1.5, 1.5], [-2.0, -2.0, -2.0]]
    assert len(batch) == 2
    part = batch.slice(slice(1, 2))
    assert part.inputs.tolist() == [[5, 6, 0]] and part.mask.tolist() == [[1.0, 0.0, 0.0]]


def test_pack_without_behaviour_or_advantages_fills_zeros() -> None:
    batch = token_batch([[1, 2, 3]], [[False, True, True]], pad_id=0)
    assert batch.behaviour_logprobs.tolist() == [[0.0, 0.0]]
    assert batch.advantages.tolist() == [[0.0, 0.0]]


def test_each_row_takes_its_own_samples_advantage_whatever_rows_the_batch_holds() -> None:
    """A rank's batch holds some of the step's samples, in its own order: each row's advantage
    (and whether it is trained) is its sample's, by the index the row carries."""
    from orchestrator.algo.base import Advantages

    advantages = Advantages(values=[[0.5, -0.5], [2.0, 0.0, -2.0]],
                            trained=[[True, True], [True, False, True]])
    batch = token_batch([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[False, True, True]] * 3, pad_id=0,
                        sample=[4, 0, 3])  # the second group's last and middle, the first's first
    batch = batch.with_advantages(*advantages.per_sample())
    assert batch.advantages.tolist() == [[-2.0, -2.0], [0.5, 0.5], [0.0, 0.0]]
    assert batch.mask.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # sample 3 is not trained
    assert batch.slice(slice(1, 3)).sample.tolist() == [0, 3]


# -- RL steps ----------------------------------------------------------------------------------


def test_rollout_groups_are_well_formed(tiny: Any) -> None:
    groups = rollout_groups(tiny, num_groups=2, group_size=4)
    assert len(groups) == 2
    for g in groups:
        assert len(g) == 4 and g.start_version == 0
        for t in g.trajectories:
            n = len(t.token_ids)
            assert len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n
            prompt = tiny.tokenizer.chat_prompt(SPEC.tasks("train")[g.prompt_id].messages)
            assert list(t.token_ids[: len(prompt)]) == prompt
            assert not any(t.loss_mask[: len(prompt)])
            assert all(t.loss_mask[len(prompt):]) and t.num_generated >= 1
            assert [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m] == [0] * t.num_generated


def test_on_policy_step_has_unit_ratio_and_weight_and_bumps_the_version(tiny: Any) -> None:
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(tiny)]
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-3)
    before = snapshot(tiny.model)
    metrics = trainer.train_step(groups)
    assert trainer.version == 1
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    # the trainer's forward agrees with the engine's behaviour log-probs
    assert metrics["importance_weight"] == pytest.approx(1.0, abs=1e-3)
    assert abs(metrics["kl_to_behaviour"]) < 1e-5
    assert metrics["clip_fraction"] == 0.0 and metrics["truncated_fraction"] == 0.0
    tokens = sum(t.num_generated for g in groups for t in g.trajectories)
    assert metrics["trained_tokens"] == tokens
    assert metrics["grad_norm"] > 0.0
    assert changed(before, tiny.model)  # rewards differ within a group: the weights move
    trainer.train_step(groups)
    assert trainer.version == 2


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_engine_and_trainer_logprobs_agree_on_the_same_weights(tiny: Any, num_minibatches: int,
                                                               caplog: Any) -> None:
    """``engine/logprob_diff``: the torch engine's behaviour log-probs against the trainer's
    recomputed ones, on the tokens the trainer's current weights sampled."""
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(tiny, seed=6)]
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-3, num_minibatches=num_minibatches)
    metrics = trainer.train_step(groups)
    print(f"torch engine logprob |diff|: mean={metrics['engine/logprob_diff']:.2e} "
          f"max={metrics['engine/logprob_diff_max']:.2e}")
    assert 0.0 <= metrics["engine/logprob_diff"] <= metrics["engine/logprob_diff_max"] < 1e-4
    assert "differ" not in caplog.text
    # A second step on the same (now one version old) samples has no fresh token to compare.
    assert "engine/logprob_diff" not in trainer.train_step(groups)


def test_a_logprob_mismatch_is_reported_and_logged(tiny: Any, caplog: Any) -> None:
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(tiny, seed=6)]
    shifted = [dataclasses.replace(g, trajectories=tuple(
        dataclasses.replace(t, logprobs=tuple(x - 0.3 for x in t.logprobs)) for t in g.trajectories
    )) for g in groups]
    metrics = TorchTrainer(tiny, GRPO(), lr=1e-3).train_step(shifted)
    assert metrics["engine/logprob_diff"] == pytest.approx(0.3, abs=1e-3)
    assert "engine and trainer log-probs differ" in caplog.text


def test_equal_rewards_leave_the_weights_unchanged(tiny: Any) -> None:
    groups = [with_rewards(g, [1.0] * 4) for g in rollout_groups(tiny, seed=1)]
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-2, weight_decay=0.0)
    before = snapshot(tiny.model)
    metrics = trainer.train_step(groups)
    assert metrics["grad_norm"] == 0.0
    assert changed(before, tiny.model) == []
    assert trainer.version == 1


def test_the_better_sample_becomes_more_likely(tiny: Any) -> None:
    (group,) = rollout_groups(tiny, num_groups=1, group_size=4, seed=2)
    group = with_rewards(group, [1.0, 0.0, 0.0, 0.0])
    best = group.trajectories[0]
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-2)

    def logprob_of_best() -> float:
        batch = token_batch([best.token_ids], [best.loss_mask], tiny.tokenizer.pad_id)
        with torch.no_grad():
            logp, _ = trainer._logprobs(batch)
        return float((logp * batch.mask).sum())

    start = logprob_of_best()
    for _ in range(3):
        trainer.train_step([group])
    assert logprob_of_best() > start


def test_micro_batching_does_not_change_the_gradient(make_policy: Any) -> None:
    groups = [with_rewards(g, [1.0, 0.0, 0.5, 0.0]) for g in rollout_groups(make_policy(0), seed=3)]
    whole = TorchTrainer(make_policy(0), GRPO(), micro_batch_size=64, max_grad_norm=1e9)
    split = TorchTrainer(make_policy(0), GRPO(), micro_batch_size=3, max_grad_norm=1e9)
    a, b = whole.train_step(groups), split.train_step(groups)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
    assert a["trained_tokens"] == b["trained_tokens"]
    for (name, p), q in zip(whole.model.state_dict().items(), split.model.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_is_the_common_untrained_start() -> None:
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5]], [[0, 0, 1, 1], [0, 0, 1, 1]]) == 2
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 4]], [[0, 0, 0, 1], [0, 0, 0, 1]]) == 3
    assert shared_prefix([[1, 2, 9], [1, 7, 9]], [[0, 0, 1], [0, 0, 1]]) == 1
    assert shared_prefix([[1, 2], [1, 2, 3, 4]], [[0, 0], [0, 0, 1, 1]]) == 1  # one to predict


def test_sharing_prefixes_changes_neither_logprobs_nor_gradients(make_policy: Any) -> None:
    """Groups with prompts of different lengths, an observation after a first turn (context
    that is not shared) and micro-batches that cut a group in two."""
    policy = make_policy(0)
    tok = policy.tokenizer
    sequences, masks, group = [], [], []
    for g, (prompt, replies) in enumerate([
        ("12+34=", ["46", "4", "461x"]),
        ("7+8=", ["15", "16", "1"]),
        ("123+456=", ["579", "57"]),
    ]):
        start = tok.chat_prompt([{"role": "user", "content": prompt}])
        for i, reply in enumerate(replies):
            ids = tok.completion(reply)
            seq, mask = start + ids, [False] * len(start) + [True] * len(ids)
            if i == 0:  # a second turn after an observation
                obs = tok.chat_prompt([{"role": "user", "content": "again"}], continuation=True)
                seq, mask = seq + obs + ids, mask + [False] * len(obs) + [True] * len(ids)
            sequences.append(seq)
            masks.append(mask)
            group.append(g)
    prefix = group_prefixes(sequences, masks, group)
    assert min(prefix) > 5
    batch = token_batch(sequences, masks, tok.pad_id, advantages=[1.0, -1.0] * 4, group=group,
                        prefix=prefix)
    results = []
    for share, micro in ((False, 64), (True, 64), (True, 4)):  # 4: cuts a group in two
        trainer = TorchTrainer(make_policy(0), GRPO(), share_prefix=share, micro_batch_size=micro)
        trainer.model.eval()
        logps, grads = [], []
        for mb in trainer._micro_batches(batch):
            logp, _ = trainer._logprobs(mb)
            (logp * mb.mask * mb.advantages).sum().backward()
            logps.append(logp * mb.mask)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        results.append((torch.cat(logps), grads))
    reference, ref_grads = results[0]
    assert reference.abs().sum() > 0
    for logp, grads in results[1:]:
        torch.testing.assert_close(logp, reference, atol=1e-5, rtol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_several_minibatches_take_several_optimiser_steps(tiny: Any) -> None:
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(tiny, seed=4)]
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-3, num_minibatches=2)
    metrics = trainer.train_step(groups)
    assert trainer.version == 1
    state = trainer.optimizer.state_dict()["state"]
    assert state and all(int(s["step"]) == 2 for s in state.values())
    # the first minibatch is on-policy; the second sees weights one update newer
    assert metrics["ratio"] != 1.0
    assert metrics["ratio"] == pytest.approx(1.0, abs=0.1)


def test_weights_are_shared_by_reference_and_the_next_step_waits_for_their_release(tiny: Any) -> None:
    trainer = TorchTrainer(tiny, GRPO(), lr=1e-2)
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(tiny)]

    async def main() -> None:
        update = await trainer.weights()
        assert isinstance(update, WeightUpdate) and update.transport == "reference"
        assert update.version == 0 and not update.released
        name, tensor = next(iter(update.tensors().items()))
        assert tensor.data_ptr() == tiny.model.state_dict()[name].data_ptr()  # no copy
        before = tensor.clone()
        async with anyio.create_task_group() as tg:
            with threads_held() as threads:
                tg.start_soon(trainer.step, groups)
                await anyio.wait_all_tasks_blocked()
                # the step waits for the release before it computes: no thread, tensors intact
                assert threads.statistics().tasks_waiting == 0
                assert trainer.version == 0 and torch.equal(tensor, before)
            update.release()
        assert trainer.version == 1 and not torch.equal(tensor, before)

    anyio.run(main)


def test_weight_update_transports_carry_the_same_tensors(tiny: Any, tmp_path: Any) -> None:
    update = WeightUpdate.of_module(3, tiny.model)
    wire = update.serialised()
    on_disk = update.to_file(tmp_path / "w.safetensors")
    assert (wire.transport, on_disk.transport) == ("bytes", "file")
    assert wire.version == on_disk.version == 3
    assert wire.nbytes > 0 and on_disk.nbytes >= wire.nbytes * 0.9
    for other in (wire, on_disk, update.detached()):
        got = other.tensors()
        assert set(got) == set(update.tensors())
        assert all(torch.equal(got[k], v) for k, v in update.tensors().items())
    # The trainer's own tensors, tied embedding and LM head sharing one storage, serialise too.
    live = WeightUpdate.by_reference(4, tiny.model.state_dict(), leased=False)
    assert set(live.serialised().tensors()) == set(live.tensors())
    assert set(live.to_file(tmp_path / "live.safetensors").tensors()) == set(live.tensors())


def test_a_mixed_trainer_of_a_bf16_model_sends_bf16(tmp_path: Any) -> None:
    """Its master weights are float32; the engines load bf16 (model.dtype): copies travel as
    bf16, half the bytes, and an update by reference stays the trainer's own tensors."""
    from orchestrator.models.policy import tiny_policy

    def policy(dtype: str = "bfloat16") -> Any:
        return tiny_policy(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                           dtype=dtype, seed=0, device="cpu")

    trainer = TorchTrainer(policy(), GRPO(), precision="mixed")
    update = anyio.run(trainer.weights)
    assert update.wire_dtype == torch.bfloat16
    own = update.tensors()
    assert {t.dtype for t in own.values() if t.is_floating_point()} == {torch.float32}
    for copy in (update.serialised(), update.to_file(tmp_path / "w.safetensors")):
        got = copy.tensors()
        assert {t.dtype for t in got.values() if t.is_floating_point()} == {torch.bfloat16}
        assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in own.items())
        assert copy.wire_dtype == torch.bfloat16  # carried: a copy's copy stays small
    assert update.serialised().nbytes < 0.6 * WeightUpdate.by_reference(
        0, own, leased=False).serialised().nbytes
    from orchestrator.weights.update import _from_arrays, _to_arrays  # the object store's payload

    stored = _from_arrays(_to_arrays(own, update.wire_dtype))
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in own.items())
    update.release()
    fp32 = TorchTrainer(policy("float32"), GRPO())
    assert anyio.run(fp32.weights).wire_dtype is None  # float32 model: as it is
    bf16 = TorchTrainer(policy("float32"), GRPO(), precision="bf16")  # smaller than the engines'
    assert anyio.run(bf16.weights).wire_dtype is None
    loaded = TorchTrainer(policy(), GRPO(), precision="fp32")  # float32 training of bf16
    assert anyio.run(loaded.weights).wire_dtype == torch.bfloat16


def test_state_dict_round_trips_weights_optimiser_and_version(make_policy: Any) -> None:
    groups = [with_rewards(g, [1.0, 0.0, 0.0, 1.0]) for g in rollout_groups(make_policy(0))]
    trainer = TorchTrainer(make_policy(0), GRPO(), lr=1e-2, warmup_steps=5)
    anyio.run(trainer.step, groups)
    other = TorchTrainer(make_policy(1), GRPO(), lr=1e-2, warmup_steps=5)
    other.load_state_dict(trainer.state_dict())
    assert other.version == 1
    assert other.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    for (name, p), q in zip(trainer.model.state_dict().items(),
                            other.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_supervised_step_lowers_the_loss_and_keeps_the_version(tiny: Any) -> None:
    trainer = TorchTrainer(tiny, GRPO())
    tok = tiny.tokenizer
    task = SPEC.tasks("train")[0]
    prompt, answer = tok.chat_prompt(task.messages), tok.completion(task.answer)
    seq, mask = [prompt + answer], [[False] * len(prompt) + [True] * len(answer)]
    optimizer = torch.optim.AdamW(tiny.model.parameters(), lr=1e-2)
    losses = [trainer.supervised_update(seq, mask, optimizer) for _ in range(5)]
    losses += [anyio.run(trainer.supervised_step, seq, mask, 1e-2) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert trainer.version == 0


def test_the_warm_starts_optimiser_state_goes_at_the_first_rl_step(tiny: Any) -> None:
    trainer = TorchTrainer(tiny, GRPO())
    tok = tiny.tokenizer
    task = SPEC.tasks("train")[0]
    prompt, answer = tok.chat_prompt(task.messages), tok.completion(task.answer)
    anyio.run(trainer.supervised_step, [prompt + answer],
              [[False] * len(prompt) + [True] * len(answer)], 1e-2)
    state = weakref.ref(next(iter(trainer._warm_optimizer.state.values()))["exp_avg"])
    assert state() is not None
    trainer.train_step(make_groups())
    gc.collect()  # a reference cycle elsewhere (an exception's frames) may hold it until then
    assert trainer._warm_optimizer is None and state() is None  # nothing holds it: freed


def test_slicing_a_batch_carries_every_per_token_field_by_name() -> None:
    """The proximal and reference log-probs travel in the batch: a slice of rows carries them
    beside the rest, and a field not computed stays None."""
    batch = token_batch([[1, 2, 3], [1, 4, 5, 6], [1, 7]],
                        [[False, True, True], [False, True, True, True], [False, True]], pad_id=0)
    proximal = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    batch = dataclasses.replace(batch, proximal_logprobs=proximal)
    part = batch.slice(slice(1, 3))
    assert part.reference_logprobs is None
    assert part.proximal_logprobs is not None
    assert part.proximal_logprobs.tolist() == proximal[1:3].tolist()
    assert part.inputs.tolist() == batch.inputs[1:3].tolist()
    assert len(part) == 2
