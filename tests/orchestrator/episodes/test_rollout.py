"""The episode runner (orchestrator/episodes/rollout.py): token-in/token-out trajectories, rewards,
multi-turn observations; and greedy evaluation (orchestrator/pipeline/evaluation.py)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
from helpers import TOK, scripted_engine

from envs.arithmetic import ArithmeticSpec
from envs.base import Env, EnvSpec, Message, Reward, RewardTerm, StepResult, Task
from orchestrator.config.schema import RolloutConfig
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.trace.recorder import Recorder
from orchestrator.types import FinishReason, SamplingParams

pytestmark = pytest.mark.anyio

SPEC = ArithmeticSpec(digits=2, train_size=8, eval_size=4, seed=0)


async def test_a_correct_reply_is_rewarded_and_laid_out_token_by_token() -> None:
    task = SPEC.tasks("train")[0]
    engine = scripted_engine(lambda _: task.answer)
    rec = Recorder()
    runner = EpisodeRunner(engine, TOK, SPEC, RolloutConfig(max_tokens=8, temperature=0.7), rec)
    t, timing = await runner.episode(task, "w", 2)
    prompt = TOK.chat_prompt(task.messages)
    reply = TOK.encode(task.answer) + [TOK.end_id]
    assert engine.replies.prompts == [prompt]
    assert engine.replies.sampling[0] == SamplingParams(max_tokens=8, temperature=0.7, stop_token_ids=TOK.stop_ids)
    assert list(t.token_ids) == prompt + reply
    assert list(t.loss_mask) == [False] * len(prompt) + [True] * len(reply)
    assert list(t.logprobs) == [0.0] * len(prompt) + [-0.5] * len(reply)
    assert list(t.versions) == [-1] * len(prompt) + [3] * len(reply)
    assert t.reward == 1.0 and t.metrics == {"reward/strict": 1.0, "episode/turns": 1.0}
    assert t.start_version == 3 and t.end_version == 3 and t.sample_index == 2
    assert t.finish_reason is FinishReason.STOP and t.num_generated == len(reply)
    assert [s.stage for s in rec.spans] == ["generate", "reward"]
    assert rec.spans[0].attributes["completion_tokens"] == len(reply)
    assert rec.spans[1].attributes["reward"] == 1.0
    assert timing.worker == "w" and len(timing.turns) == 1
    assert timing.turns[0].completion_tokens == len(reply)


async def test_a_wrong_reply_gets_nothing() -> None:
    task = SPEC.tasks("train")[1]
    runner = EpisodeRunner(scripted_engine(lambda _: task.answer + "1"), TOK, SPEC,
                           RolloutConfig(), Recorder())
    t, _ = await runner.episode(task, "w")
    assert t.reward == 0.0


async def test_a_group_runs_every_sample_of_one_task() -> None:
    task = SPEC.tasks("train")[2]
    answers = iter([task.answer, "x", task.answer, "y"])
    engine = scripted_engine(lambda _: next(answers))
    runner = EpisodeRunner(engine, TOK, SPEC, RolloutConfig(group_size=4), Recorder())
    timed = await runner.group(task, "w", queue_wait=0.5)
    group, timing = timed.group, timed.timing
    assert len(group) == 4 and group.prompt_id == task.id and group.start_version == 3
    assert sorted(t.sample_index for t in group.trajectories) == [0, 1, 2, 3]
    assert sorted(group.rewards) == [0.0, 0.0, 1.0, 1.0]
    assert timing.finished_at >= timing.started_at and timing.queue_wait == 0.5
    assert len(timing.episodes) == 4  # one each, in the trajectories' order


class EchoEnv(Env):
    """Two turns: the first reply is echoed back as a tool message; reward = number of turns
    (one weighted term)."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, task: Task) -> tuple[Message, ...]:
        return task.messages

    async def step(self, reply: str) -> StepResult:
        self.turns += 1
        done = self.turns >= 2
        observation = () if done else ({"role": "tool", "content": f"got {reply}"},)
        return StepResult(observation=observation, reward=0.25, done=done, metrics={"turns": 1.0})

    async def reward(self) -> Reward:
        return Reward.weighted([RewardTerm("turns", 1.0, float(self.turns))])


class EchoSpec(EnvSpec):
    name = "echo"

    def tasks(self, split: str) -> Sequence[Task]:
        return [Task(id=0, messages=({"role": "user", "content": "hi"},), answer="")]

    def make_env(self) -> Env:
        return EchoEnv()


async def test_observations_are_appended_and_never_trained_on() -> None:
    spec = EchoSpec()
    replies = iter(["ab", "c"])
    engine = scripted_engine(lambda _: next(replies))
    runner = EpisodeRunner(engine, TOK, spec, RolloutConfig(max_turns=3), Recorder())
    t, _ = await runner.episode(spec.tasks("train")[0], "w")
    prompt = TOK.chat_prompt([{"role": "user", "content": "hi"}])
    first = TOK.encode("ab") + [TOK.end_id]
    observation = TOK.chat_prompt([{"role": "tool", "content": "got ab"}], continuation=True)
    second = TOK.encode("c") + [TOK.end_id]
    assert list(t.token_ids) == prompt + first + observation + second
    # the second turn was generated from exactly the tokens so far (nothing re-tokenised)
    assert engine.replies.prompts == [prompt, prompt + first + observation]
    assert list(t.loss_mask) == ([False] * len(prompt) + [True] * len(first)
                                 + [False] * len(observation) + [True] * len(second))
    assert t.reward == 0.25 + 0.25 + 2.0
    # per-turn metrics add up over the episode
    assert t.metrics["turns"] == 2 and t.metrics["reward/turns"] == 2.0
    # the reward's weighted terms travel typed (reward/turns above is for logging)
    assert t.reward_terms == (RewardTerm("turns", 1.0, 2.0),)


async def test_max_turns_ends_the_episode() -> None:
    spec = EchoSpec()
    engine = scripted_engine(lambda _: "z")
    runner = EpisodeRunner(engine, TOK, spec, RolloutConfig(max_turns=1), Recorder())
    t, _ = await runner.episode(spec.tasks("train")[0], "w")
    assert len(engine.replies.prompts) == 1
    assert t.reward == 0.25 + 1.0


async def test_evaluate_is_greedy_and_averages_rewards() -> None:
    tasks = SPEC.tasks("eval")
    right = {tuple(TOK.chat_prompt(t.messages)): t.answer for t in tasks[:3]}
    engine = scripted_engine(lambda prompt: right.get(tuple(prompt), "wrong"))
    with anyio.fail_after(10):
        score = await evaluate(EpisodeRunner(engine, TOK, SPEC, RolloutConfig(temperature=1.0),
                                             Recorder()), tasks)
    assert score.mean == pytest.approx(3 / 4) and score.n == 1
    assert all(s.temperature == 0.0 for s in engine.replies.sampling)
