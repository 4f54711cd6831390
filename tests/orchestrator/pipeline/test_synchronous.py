"""k = 0 is the synchronous algorithm, bit for bit.

The pipeline at ``pipeline.max_staleness=0`` (the run loop every run goes through: rollout
workers, admission, the trainer and weight sync in one task group) against a synchronous
loop written here the plain way: per step, take the sampler's next ``B / group_size`` tasks,
sample every one of their episodes at once on an engine of the same class (each sample
seeded by its task's draw and its index in the group), score each with the environment's
reward, then one train step (the trainer's advantage estimator and update) and load its
weights. The weights after every step must be identical, not close: at k = 0 nothing of the
pipeline's concurrency (which worker took which task, which group finished first, which
requests shared an engine step) may reach what is trained. (verl's fully asynchronous mode
at k = 0 does not match its synchronous trainer, verl#6780.)

The samples must be the same too, bit for bit: the same tasks in the same order, the same
tokens, behaviour log-probs, versions and rewards, and so must the optimiser's state. (The
torch engine's forward pass is not batch-invariant, so even the log-probs need the engine's
steps to hold the same requests: a version's groups reach it over a few turns of the event
loop, and it takes such a burst whole, ``TorchEngine._settle``.)
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from helpers import quick_config

from envs.base import Task
from orchestrator.builders import training_parts
from orchestrator.config.run import run_config
from orchestrator.config.schema import WarmStartConfig
from orchestrator.engines.base import InferenceEngine, sync_weights
from orchestrator.episodes.rollout import sample_seed
from orchestrator.run.loop import RunParts, RunResult, run_session
from orchestrator.run.warmstart import warm_start
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import Group, SamplingParams, StepReport, Trajectory

pytestmark = pytest.mark.anyio

STEPS = 20
WARM_STEPS = 120  # about a third of the samples right after it


async def parts() -> RunParts:
    """The smoke experiment on the tests' one-layer model at k = 0: 20 steps of 4 groups of
    4 on one-digit sums, more workers than a step's groups (workers wait for admission), no
    evaluation; the weights warm-started here (the same supervised steps for both runs), so
    that some samples are right and the advantages are not all zero."""
    cfg = quick_config("smoke", "pipeline.max_staleness=0", f"pipeline.num_steps={STEPS}",
                       "pipeline.batch_size=16", "pipeline.num_workers=6", "warmstart.steps=0",
                       "eval.num_tasks=0", "env.digits=1", "torch_threads=1")
    run = training_parts(run_config(cfg))
    await warm_start(run.trainer, run.tokenizer, run.spec.tasks("train"),
                     WarmStartConfig(steps=WARM_STEPS, batch_size=32, lr=3e-3,
                                     target_accuracy=None),
                     seed=run.seed)
    return run


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    assert isinstance(trainer, TorchTrainer)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


async def pipeline_run(run: RunParts) -> tuple[list[dict[str, torch.Tensor]], list[tuple[Group, ...]]]:
    """The weights after each step of the real run loop, and each step's batch."""
    after: list[dict[str, torch.Tensor]] = []
    batches: list[tuple[Group, ...]] = []

    def on_step(report: StepReport) -> None:  # the trainer's tensors wait for the next step
        after.append(weights(run.trainer))
        batches.append(report.groups)

    await run_session(run, RunResult(run_dir=None), on_step)
    return after, batches


async def episode(engine: InferenceEngine, run: RunParts, task: Task, draw: int,
                  index: int) -> Trajectory:
    """One sample: the prompt, one generation, the environment's reward."""
    tokenizer, rollout = run.tokenizer, run.rollout
    seed = sample_seed(sample_seed(sample_seed(run.seed, draw), index), 0)  # task, sample, turn
    async with run.spec.make_env() as env:
        prompt = tokenizer.chat_prompt(await env.reset(task))
        gen = await engine.generate(prompt, SamplingParams(
            max_tokens=rollout.max_tokens, temperature=rollout.temperature,
            stop_token_ids=tokenizer.stop_ids, seed=seed))
        reply = [t for t in gen.token_ids if t not in tokenizer.stop_ids]
        result = await env.step(tokenizer.decode(reply))
        assert result.done
        reward = result.reward + (await env.reward()).total
    return Trajectory(
        prompt_id=task.id, sample_index=index, token_ids=(*prompt, *gen.token_ids),
        loss_mask=(False,) * len(prompt) + (True,) * len(gen.token_ids),
        logprobs=(0.0,) * len(prompt) + gen.logprobs,
        versions=(-1,) * len(prompt) + gen.versions, reward=reward,
        start_version=gen.versions[0], finish_reason=gen.finish_reason)


async def synchronous_run(run: RunParts) -> tuple[list[dict[str, torch.Tensor]], list[tuple[Group, ...]]]:
    """The synchronous algorithm: sample the whole batch, score it, one train step, load."""
    trainer, size = run.trainer, run.rollout.group_size
    prompts = run.pipeline.batch_size // size
    after: list[dict[str, torch.Tensor]] = []
    batches: list[tuple[Group, ...]] = []
    async with run.spec.running():
        update = await trainer.weights()
        engine = run.make_engine(update, Recorder())
        update.release()
        async with engine:
            for step in range(STEPS):
                draws = range(step * prompts, (step + 1) * prompts)
                tasks = [run.sampler.next() for _ in draws]
                samples: dict[tuple[int, int], Trajectory] = {}

                async def one(into: dict[tuple[int, int], Trajectory], task: Task, draw: int,
                              index: int) -> None:
                    into[draw, index] = await episode(engine, run, task, draw, index)

                async with anyio.create_task_group() as tg:  # the whole batch at once
                    for task, draw in zip(tasks, draws, strict=True):
                        for index in range(size):
                            tg.start_soon(one, samples, task, draw, index)
                groups = tuple(
                    Group(task.id, tuple(samples[draw, i] for i in range(size)), step)
                    for task, draw in zip(tasks, draws, strict=True))
                await trainer.step(groups)
                after.append(weights(trainer))
                batches.append(groups)
                await sync_weights(engine, await trainer.weights())
    return after, batches


def same_samples(a: tuple[Group, ...], b: tuple[Group, ...]) -> bool:
    """The same tasks, in the same order, with the same samples."""
    def key(groups: tuple[Group, ...]) -> list[Any]:
        return [(g.prompt_id, g.start_version,
                 [(t.sample_index, t.token_ids, t.logprobs, t.versions, t.reward)
                  for t in g.trajectories]) for g in groups]
    return key(a) == key(b)


async def test_k0_pipeline_equals_the_synchronous_loop_bit_for_bit() -> None:
    pipelined, synchronous = await parts(), await parts()
    assert all(torch.equal(a, b) for a, b in zip(
        weights(pipelined.trainer).values(), weights(synchronous.trainer).values(), strict=True))
    with anyio.fail_after(120):
        got, got_batches = await pipeline_run(pipelined)
        want, want_batches = await synchronous_run(synchronous)
    assert len(got) == len(want) == STEPS
    for step in range(STEPS):
        assert same_samples(got_batches[step], want_batches[step]), \
            f"step {step}: the pipeline sampled another batch than the synchronous loop"
        differ = [k for k in want[step] if not torch.equal(got[step][k], want[step][k])]
        assert not differ, f"step {step}: weights differ in {differ}"
    optimisers = (pipelined.trainer.optimizer.state, synchronous.trainer.optimizer.state)
    assert isinstance(pipelined.trainer, TorchTrainer) and isinstance(synchronous.trainer, TorchTrainer)
    assert all(torch.equal(x, y) for a, b in zip(*(s.values() for s in optimisers), strict=True)
               for x, y in zip(a.values(), b.values(), strict=True))
    # and it trained: some samples were right, and the weights moved at every step
    assert 0 < sum(t.reward for b in want_batches for g in b for t in g.trajectories) < 16 * STEPS
    assert all(any(not torch.equal(got[s - 1][k], got[s][k]) for k in got[s])
               for s in range(1, STEPS))
