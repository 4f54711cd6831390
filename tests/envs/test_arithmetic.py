"""The arithmetic environment and the environment registry (envs/)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from envs.arithmetic import ArithmeticEnv, ArithmeticSpec
from envs.base import Env, EnvSpec, Task
from envs.errors import EnvConfigError, EnvError
from envs.registry import available, default_config, make_spec, spec_class
from envs.reward_builtins import strict_reward
from envs.rewards import Scorer

pytestmark = pytest.mark.anyio


def contents(tasks: Sequence[Task]) -> list[str]:
    return [t.messages[0]["content"] for t in tasks]


def test_tasks_are_deterministic_per_seed() -> None:
    a, b = ArithmeticSpec(seed=3, train_size=50, eval_size=10), ArithmeticSpec(seed=3, train_size=50, eval_size=10)
    assert a.tasks("train") == b.tasks("train") and a.tasks("eval") == b.tasks("eval")
    c = ArithmeticSpec(seed=4, train_size=50, eval_size=10)
    assert contents(c.tasks("train")) != contents(a.tasks("train"))


def test_splits_have_their_sizes_ids_and_are_disjoint() -> None:
    spec = ArithmeticSpec(digits=2, train_size=300, eval_size=40, seed=1)
    train, evals = spec.tasks("train"), spec.tasks("eval")
    assert len(train) == 300 and len(evals) == 40
    assert [t.id for t in train] == list(range(300)) and [t.id for t in evals] == list(range(40))
    assert len(set(contents(train))) == 300  # no duplicates within a split
    assert not set(contents(train)) & set(contents(evals))


@pytest.mark.parametrize(("ops", "digits", "zero_pad"), [
    (("+",), 2, True), (("+", "-", "*"), 2, True), (("-",), 3, False), (("*",), 1, True),
])
def test_answers_are_correct(ops: tuple[str, ...], digits: int, zero_pad: bool) -> None:
    spec = ArithmeticSpec(digits=digits, ops=ops, train_size=60, eval_size=10, seed=2, zero_pad=zero_pad)
    pattern = re.compile(r"^(\d+)([+*-])(\d+)=$")
    for task in [*spec.tasks("train"), *spec.tasks("eval")]:
        (message,) = task.messages
        assert message["role"] == "user"
        match = pattern.match(message["content"])
        assert match, message["content"]
        a, op, b = match.groups()
        if zero_pad:
            assert len(a) == len(b) == digits
        assert op in ops
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert task.answer == str(expected)


def test_zero_padding() -> None:
    padded = ArithmeticSpec(digits=3, train_size=200, eval_size=0, seed=0, zero_pad=True)
    plain = ArithmeticSpec(digits=3, train_size=200, eval_size=0, seed=0, zero_pad=False)
    assert all(len(c) == 8 for c in contents(padded.tasks("train")))
    assert any(len(c) < 8 for c in contents(plain.tasks("train")))


@pytest.mark.parametrize(("reply", "reward"), [
    ("42", 1.0), (" 42\n", 1.0), ("\t42  ", 1.0), ("042", 0.0), ("43", 0.0), ("4 2", 0.0), ("", 0.0),
])
def test_strict_the_default(reply: str, reward: float) -> None:
    assert strict_reward(reply, "42", {}) == reward


async def test_an_episode_is_one_turn_scored_by_exact_match() -> None:
    spec = ArithmeticSpec(train_size=5, eval_size=0)
    task = spec.tasks("train")[0]
    async with spec.make_env() as env:
        assert await env.reset(task) == task.messages
        step = await env.step(f" {task.answer} ")
        assert step.done and step.reward == 0.0 and step.observation == ()
        reward = await env.reward()
        assert reward.total == 1.0 and reward.components == {"strict": 1.0}
    env = spec.make_env()
    await env.reset(task)
    await env.step(task.answer + "0")
    assert (await env.reward()).total == 0.0


async def test_env_refuses_out_of_order_calls() -> None:
    env = ArithmeticEnv(Scorer("strict"))
    with pytest.raises(RuntimeError):
        await env.step("1")
    with pytest.raises(RuntimeError):
        await env.reward()
    await env.reset(Task(id=0, messages=(), answer="1"))
    with pytest.raises(RuntimeError):
        await env.reward()


def test_construction_rejects_more_tasks_than_problems() -> None:
    # one digit, one operator: 10 * 10 distinct problems
    ArithmeticSpec(digits=1, train_size=90, eval_size=10)
    with pytest.raises(ValueError, match="train_size"):
        ArithmeticSpec(digits=1, train_size=90, eval_size=11)
    with pytest.raises(ValueError, match="train_size"):
        ArithmeticSpec(digits=1, ops=("+", "-"), train_size=150, eval_size=51)


@pytest.mark.parametrize("kwargs", [{"ops": ("/",)}, {"digits": 0}])
def test_construction_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArithmeticSpec(train_size=1, eval_size=1, **kwargs)


def test_unknown_split_is_named() -> None:
    with pytest.raises(KeyError, match=r"unknown split 'valid'; choose from \['eval', 'train'\]"):
        ArithmeticSpec(train_size=1, eval_size=1).tasks("valid")


def test_a_spec_without_splits_or_its_own_tasks_says_which_to_add() -> None:
    class NoTasks(EnvSpec):
        def make_env(self) -> Env:
            return ArithmeticEnv(Scorer("strict"))

    with pytest.raises(NotImplementedError, match="set self.splits in its constructor or override tasks"):
        NoTasks().tasks("train")


def test_a_bad_setting_is_an_env_config_error_the_entry_point_reports() -> None:
    with pytest.raises(EnvConfigError, match="env.digits"):
        ArithmeticSpec(digits=0)
    assert issubclass(EnvConfigError, ValueError) and issubclass(EnvConfigError, EnvError)


# -- registry ------------------------------------------------------------------------------------


def test_registry_builds_by_name() -> None:
    assert "arithmetic" in available()
    spec = make_spec("arithmetic", digits=1, train_size=3, eval_size=2)
    assert isinstance(spec, ArithmeticSpec) and spec.name == "arithmetic"
    assert len(spec.tasks("train")) == 3


def test_unknown_environment_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError) as info:
        make_spec("chess")
    message = info.value.args[0]
    assert "chess" in message
    for name in available():
        assert name in message


def test_built_ins_register_through_entry_points_like_plugins() -> None:
    from importlib.metadata import entry_points

    declared = {ep.name: ep.value for ep in entry_points(group="polyrl.envs")}
    assert declared["arithmetic"] == "envs.arithmetic:ArithmeticSpec"
    assert {"arithmetic", "code", "code_tool", "search_qa"} <= set(available())
    assert spec_class("code_tool").__name__ == "CodeToolSpec"


def test_a_shipped_env_file_names_the_class_its_entry_point_names() -> None:
    """``conf/env/<name>.yaml`` and the entry point agree, and the default config of a
    registered class is a ``_target_`` node like every other group's."""
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf" / "env"
    for path in conf.glob("*.yaml"):
        target = OmegaConf.load(path)["_target_"]
        cls = spec_class(path.stem)
        assert target == f"{cls.__module__}.{cls.__qualname__}", path.name
    config = default_config("arithmetic")
    assert config["_target_"] == "envs.arithmetic.ArithmeticSpec" and config["digits"] == 2
