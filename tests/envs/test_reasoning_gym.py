"""reasoning-gym datasets as environments (envs/reasoning_gym.py), on datasets whose answers
are a number (basic_arithmetic), a word (spell_backward) and a grid (rotate_matrix)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("reasoning_gym")

from envs.base import Task
from envs.reasoning_gym import (
    INSTALL_HINT,
    ReasoningGymEnv,
    ReasoningGymSpec,
    dataset_names,
    extract_answer,
)
from envs.registry import available, default_config, make_spec, spec_class

pytestmark = pytest.mark.anyio

CONF = Path(__file__).resolve().parents[2] / "conf"
# dataset -> small keyword arguments, one per answer shape
SHAPES: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 2},  # a number
    "spell_backward": {"min_word_len": 3, "max_word_len": 6},  # a word
    "rotate_matrix": {"min_n": 2, "max_n": 3},  # a grid, one row per line
}


def spec(dataset: str, seed: int = 0, train: int = 40, evals: int = 10, **kwargs: Any) -> ReasoningGymSpec:
    return ReasoningGymSpec(dataset=dataset, config=SHAPES.get(dataset), train_size=train,
                            eval_size=evals, seed=seed, **kwargs)


def questions(tasks: Sequence[Task]) -> list[str]:
    return [t.messages[0]["content"] for t in tasks]


async def reward(s: ReasoningGymSpec, task: Task, reply: str) -> dict[str, float]:
    env = s.make_env()
    async with env:
        assert await env.reset(task) == task.messages
        assert (await env.step(reply)).done
        result = await env.reward()
    return {"total": result.total, **result.components}


@pytest.mark.parametrize("dataset", sorted(SHAPES))
def test_splits_are_seeded_reproducible_and_disjoint(dataset: str) -> None:
    a, b, other = spec(dataset, seed=3), spec(dataset, seed=3), spec(dataset, seed=4)
    assert questions(a.tasks("train")) == questions(b.tasks("train"))
    assert questions(a.tasks("eval")) == questions(b.tasks("eval"))
    assert questions(other.tasks("train")) != questions(a.tasks("train"))
    train, evals = a.tasks("train"), a.tasks("eval")
    assert [t.id for t in train] == list(range(40)) and [t.id for t in evals] == list(range(10))
    assert len(set(questions(train))) == 40 and len(set(questions(evals))) == 10
    assert not set(questions(train)) & set(questions(evals))


def test_eval_never_repeats_a_train_question_even_in_a_small_universe() -> None:
    # sums of two numbers from 0 to 10: 121 questions in all, so the splits' datasets collide
    sums = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False}
    s = ReasoningGymSpec("basic_arithmetic", sums, train_size=100, eval_size=21, seed=0)
    train, evals = set(questions(s.tasks("train"))), set(questions(s.tasks("eval")))
    assert len(train) == 100 and len(evals) == 21 and not train & evals
    with pytest.raises(ValueError, match=r"^env.eval_size=22 is more than the 21 distinct eval "
                                         r"questions basic_arithmetic gave in \d+ tries"):
        ReasoningGymSpec("basic_arithmetic", sums, train_size=100, eval_size=22, seed=0)


@pytest.mark.parametrize("dataset", sorted(SHAPES))
async def test_the_datasets_verifier_rewards_its_answer_and_not_a_wrong_one(dataset: str) -> None:
    s = spec(dataset)
    for task in [*s.tasks("train")[:5], *s.tasks("eval")[:5]]:
        entry = task.metadata["entry"]
        assert task.answer == entry["answer"] and task.messages == (
            {"role": "user", "content": entry["question"]},)
        right = await reward(s, task, task.answer)
        assert right["total"] == right["verifier"] == right["exact_match"] == 1.0
        tagged = await reward(s, task, f"Let me think.\n<answer>\n{task.answer}\n</answer>")
        assert tagged["total"] == tagged["tagged"] == 1.0
        wrong = await reward(s, task, f"<answer>{task.answer}x9</answer>")
        assert wrong["total"] < 1.0 and wrong["exact_match"] == 0.0
        assert (await reward(s, task, ""))["total"] == 0.0


def test_the_warm_start_learns_the_datasets_own_answer() -> None:
    s = spec("rotate_matrix")
    task = s.tasks("train")[0]
    assert "\n" in task.answer  # a grid, row per line
    assert s.demonstration(task) == (*task.messages, {"role": "assistant", "content": task.answer})


@pytest.mark.parametrize(("completion", "answer"), [
    ("42", "42"),
    ("  42 \n", "42"),
    ("<answer>42</answer>", "42"),
    ("I think <answer> 17 </answer>, no: <answer>42</answer> done", "42"),  # the last one
    ("<answer>\n1 2\n3 4\n</answer>", "1 2\n3 4"),  # grids keep their lines
    ("1 2\n3 4", "1 2\n3 4"),
    ("<answer>42", "<answer>42"),  # an unclosed tag is not a tag
])
def test_answer_extraction(completion: str, answer: str) -> None:
    assert extract_answer(completion) == answer


async def test_a_verifier_that_raises_scores_zero() -> None:
    class Broken:
        def score_answer(self, answer: str, entry: dict[str, Any]) -> float:
            raise ValueError("cannot parse")

    spec = ReasoningGymSpec(train_size=2, eval_size=0)
    spec._verifier = Broken()
    env = ReasoningGymEnv(spec)
    task = Task(id=0, messages=({"role": "user", "content": "q"},), answer="a",
                metadata={"entry": {"question": "q", "answer": "a"}})
    await env.reset(task)
    await env.step("???")
    result = await env.reward()
    assert result.total == 0.0 and result.components["verifier/error"] == 1.0
    assert "failed" not in result.components  # a model's garbage, not a reward failure


def test_an_unknown_dataset_is_one_line_with_close_names() -> None:
    with pytest.raises(ValueError) as error:
        ReasoningGymSpec(dataset="basic_arithmetc")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("env.dataset=basic_arithmetc is not a reasoning-gym dataset; did you mean ")
    assert "basic_arithmetic" in message
    with pytest.raises(ValueError, match=r"^env.dataset=zzzz is not a reasoning-gym dataset; e\.g\. "):
        ReasoningGymSpec(dataset="zzzz")


def test_an_unknown_dataset_through_the_config_is_one_line() -> None:
    from hydra import compose, initialize_config_dir

    from orchestrator.config.read import build_env
    from orchestrator.errors import ConfigError

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["env=reasoning_gym", "env.dataset=spell_backwards"])
    with pytest.raises(ConfigError) as error:
        build_env(cfg)
    assert str(error.value).splitlines() == [
        "env.dataset=spell_backwards is not a reasoning-gym dataset; did you mean spell_backward?"]


@pytest.mark.parametrize(("config", "message"), [
    ({"max_digit": 2}, "unknown config key 'env.config.max_digit' for dataset basic_arithmetic; known: "),
    ({"seed": 1}, "env.config.seed is set by env.seed"),
    ({"min_terms": 5, "max_terms": 2}, "env.config for basic_arithmetic is invalid: "),
])
def test_a_bad_dataset_config_is_one_line(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        ReasoningGymSpec("basic_arithmetic", config, train_size=5, eval_size=1)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_without_reasoning_gym_installed_one_line_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # import fails
    with pytest.raises(ValueError, match=r"^env=reasoning_gym needs the reasoning-gym package: "
                                         r"pip install -e \.\[tasks\]$"):
        ReasoningGymSpec("basic_arithmetic")
    assert "pip install -e .[tasks]" in INSTALL_HINT


def test_ascii_only_skips_what_the_char_tokenizer_cannot_write() -> None:
    division = {"operations": ["/"], "operations_weights": [1.0]}  # questions say "÷"
    with pytest.raises(ValueError, match="ascii_only skips entries"):
        ReasoningGymSpec("complex_arithmetic", division, train_size=5, eval_size=1)
    s = ReasoningGymSpec("complex_arithmetic", division, train_size=5, eval_size=1, ascii_only=False)
    assert all("÷" in q for q in questions(s.tasks("train")))
    mixed = ReasoningGymSpec("complex_arithmetic", train_size=30, eval_size=5)
    printable = set("\n" + "".join(chr(c) for c in range(32, 127)))
    assert all(set(q) <= printable for q in questions([*mixed.tasks("train"), *mixed.tasks("eval")]))


def test_the_env_goes_through_the_registry_by_name() -> None:
    assert "reasoning_gym" in available()
    assert spec_class("reasoning_gym") is ReasoningGymSpec
    config = default_config("reasoning_gym")
    assert config["_target_"] == "envs.reasoning_gym.ReasoningGymSpec"
    assert {"dataset", "config", "train_size", "eval_size", "seed", "ascii_only"} <= set(config)
    s = make_spec("reasoning_gym", dataset="spell_backward", config=SHAPES["spell_backward"],
                  train_size=8, eval_size=2)
    assert isinstance(s, ReasoningGymSpec) and s.name == "reasoning_gym"
    assert len(s.tasks("train")) == 8
    with pytest.raises(KeyError, match="unknown split"):
        s.tasks("test")
    assert {"basic_arithmetic", "spell_backward", "rotate_matrix"} <= set(dataset_names())
