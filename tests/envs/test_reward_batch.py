"""TRL-style rewards called batched (envs/reward_batch.py through envs.rewards.Scorer): the
samples scored at about the same time share one call of ``fn(prompts, completions,
**columns)`` in a reward worker, and failures are still counted per sample, by name and kind:
a call that fails fails every sample of its batch once; a value that is no number fails its own
sample only."""

from __future__ import annotations

import anyio
import pytest

from envs.base import Reward
from envs.reward_functions import Sample
from envs.rewards import Scorer

pytestmark = pytest.mark.anyio
PROMPT = ({"role": "user", "content": "1+1="},)


async def score_together(reward: str, n: int) -> tuple[list[Reward], dict[str, float]]:
    """``n`` samples scored at once (a group's episodes finishing together)."""
    rewards: list[Reward | None] = [None] * n
    async with Scorer(reward, timeout_s=20.0) as scorer:

        async def one(i: int) -> None:
            rewards[i] = await scorer.score(Sample(str(i), "0", {"index": i}, PROMPT))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        metrics = scorer.metrics()
    assert all(r is not None for r in rewards)
    return [r for r in rewards if r is not None], metrics


async def test_a_trl_function_is_called_once_for_samples_scored_together() -> None:
    # each sample scores the size of the batch it was in: 8 together, one call (per sample,
    # each would score 1)
    rewards, metrics = await score_together("dataset_reward_fns:trl_batch_size", 8)
    assert [r.total for r in rewards] == [8.0] * 8
    assert metrics["reward/errors"] == 0
    # one alone is a batch of one
    alone, _ = await score_together("dataset_reward_fns:trl_batch_size", 1)
    assert alone[0].total == 1.0


@pytest.mark.parametrize(("reward", "kind"), [("trl_raises", "error"),
                                              ("trl_one_short", "invalid")])
async def test_a_batched_call_that_fails_fails_each_of_its_samples_once(reward: str,
                                                                        kind: str) -> None:
    name = f"dataset_reward_fns:{reward}"
    rewards, metrics = await score_together(name, 6)
    assert [r.total for r in rewards] == [0.0] * 6
    assert all(r.components["failed"] == 1.0 for r in rewards)
    assert metrics[f"reward/failed/{name}/{kind}"] == 6


async def test_a_value_that_is_no_number_fails_only_its_own_sample() -> None:
    name = "dataset_reward_fns:trl_odd_is_text"
    rewards, metrics = await score_together(name, 6)
    assert [r.total for r in rewards] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [("failed" in r.components) for r in rewards] == [False, True] * 3
    assert metrics[f"reward/failed/{name}/invalid"] == 3
