"""``env=dataset``: a user's files in every format and schema, their bad input, the order a
resumed run keeps, and a run from a file end to end (envs/dataset.py, orchestrator/builders.py)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import anyio
import pytest

pd = pytest.importorskip("pandas", reason="the data extra (scripts/setup.sh installs it)")
from helpers import REPO
from hydra import compose, initialize_config_dir

from envs.dataset import DatasetSpec, DatasetTask
from envs.errors import EnvConfigError
from orchestrator.pipeline.pipeline import TaskSampler


def verl_rows(n: int, source: str = "arith") -> list[dict]:
    return [{"data_source": source, "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i}} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    from datasets import Dataset

    plain = [{"question": f"{i}*3=", "answer": str(3 * i), "difficulty": "easy"} for i in range(12)]
    out = {
        "verl_parquet": tmp_path / "verl.parquet",
        "verl_jsonl": write_jsonl(tmp_path / "verl.jsonl", verl_rows(10, "jsonl_src")),
        "trl_json": tmp_path / "trl.json",
        "plain_csv": tmp_path / "plain.csv",
        "arrow": tmp_path / "plain.arrow",
        "disk": tmp_path / "saved",
    }
    pd.DataFrame(verl_rows(20)).to_parquet(out["verl_parquet"])
    out["trl_json"].write_text(json.dumps(
        [{"prompt": f"Name {i}", "completion_hint": "x", "answer": f"n{i}"} for i in range(8)]))
    pd.DataFrame(plain).to_csv(out["plain_csv"], index=False)
    Dataset.from_list([{"problem": f"p{i}", "solution": f"s{i}"} for i in range(6)]).save_to_disk(
        str(out["disk"]))
    Dataset.from_list(plain[:5]).save_to_disk(str(tmp_path / "arrowdir"))
    (tmp_path / "arrowdir" / "data-00000-of-00001.arrow").rename(out["arrow"])
    return out


def test_every_format_and_schema(files: dict[str, Path]) -> None:
    spec = DatasetSpec(train=str(files["verl_parquet"]), eval=str(files["verl_jsonl"]))
    task = spec.tasks("train")[3]
    assert isinstance(task, DatasetTask)
    assert task.messages == ({"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is 3+3?"})
    assert task.answer == "6" and task.source == "arith" and task.row == 4
    assert task.metadata["ability"] == "math" and task.metadata["extra_info"] == {"index": 3}
    assert "prompt" not in task.metadata
    assert spec.tasks("eval")[0].source == "jsonl_src"

    trl = DatasetSpec(train=str(files["trl_json"]), system_prompt="S", instruction="Be exact.")
    task = trl.tasks("train")[1]
    assert task.messages == ({"role": "system", "content": "S"},
                             {"role": "user", "content": "Name 1 Be exact."})
    assert task.metadata == {"completion_hint": "x", "answer": "n1", "data_source": "trl"}
    plain = DatasetSpec(train=str(files["plain_csv"]))
    assert plain.tasks("train")[2].answer == "6"
    assert plain.tasks("train")[2].metadata["difficulty"] == "easy"
    assert len(DatasetSpec(train=str(files["arrow"])).tasks("train")) == 5
    disk = DatasetSpec(train=str(files["disk"]))
    assert disk.tasks("train")[5].answer == "s5" and disk.tasks("train")[5].source == "saved"
    # a glob and a list are one source; keys override
    both = DatasetSpec(train=str(files["verl_parquet"].parent / "verl.*"),
                       answer_key="extra_info.index", prompt_key="prompt")
    assert len(both.tasks("train")) == 30  # sorted: verl.jsonl first
    assert both.tasks("train")[5].answer == "5" and both.tasks("train")[25].answer == "15"


def test_a_weighted_mixture_counts_samples_per_source(files: dict[str, Path]) -> None:
    spec = DatasetSpec(train=[{"path": str(files["verl_parquet"]), "weight": 0.75},
                              {"path": str(files["plain_csv"]), "weight": 0.25}])
    tasks = spec.tasks("train")
    assert len(tasks) == 32  # 20 + 12 rows an epoch, shared 24 : 8
    assert Counter(t.source for t in tasks) == {"arith": 24, "plain": 8}
    assert len({t.answer for t in tasks if t.source == "arith"}) == 20  # every row, some twice
    assert [t.id for t in tasks] == list(range(32))

    async def episodes() -> dict[str, float]:
        async with spec.running():
            for task in list(tasks)[:3] + list(tasks)[-1:]:
                env = spec.make_env()
                await env.reset(task)
                await env.step(r"\boxed{0}")
                await env.reward()
            return spec.metrics()

    metrics = anyio.run(episodes)
    assert metrics["data/samples/arith"] == 3 and metrics["data/samples/plain"] == 1
    assert metrics["reward/timeouts"] == metrics["reward/errors"] == 0


def test_duplicates_between_train_and_eval_are_reported(files: dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        spec = DatasetSpec(train=str(files["verl_parquet"]), eval=str(files["verl_jsonl"]))
    assert spec.duplicates == 10
    assert "10 train rows have the same prompt as an eval row" in caplog.text


def test_resume_neither_repeats_nor_skips_within_an_epoch(files: dict[str, Path]) -> None:
    tasks = DatasetSpec(train=str(files["verl_parquet"])).tasks("train")
    whole = TaskSampler(tasks, seed=7)
    epoch = [whole.next().id for _ in range(20)]
    assert sorted(epoch) == list(range(20))

    first = TaskSampler(tasks, seed=7)
    handed = [first.next().id for _ in range(9)]
    for task_id in handed[:6]:  # trained before the checkpoint; 3 still in flight
        first.settle(task_id)
    state = json.loads(json.dumps(first.state_dict()))  # through the checkpoint's JSON
    resumed = TaskSampler(DatasetSpec(train=str(files["verl_parquet"])).tasks("train"), seed=7)
    resumed.load_state_dict(state)
    rest = [resumed.next().id for _ in range(14)]
    assert sorted(handed[:6] + rest) == list(range(20))
    assert rest[:3] == handed[6:9] and rest[3:] == epoch[9:]


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: {"train": str(d / "missing.jsonl")}, "env.train: no such file"),
    (lambda d: {"train": str(d / "none-*.jsonl")}, "env.train: no file matches"),
    (lambda d: {"train": str(write_jsonl(d / "a.txt", [{}]))}, "unknown extension '.txt'"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"text": "x", "answer": "1"}]))},
     ("has no prompt column (prompt, messages, question, problem); set env.prompt_key; "
      "its columns: text, answer")),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"question": "x", "label": "1"}]))},
     "no answer column"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"question": "q", "answer": "1"},
                                                         {"question": "q", "answer": " "}]))},
     "a.jsonl row 2 key 'answer': the answer is empty"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"prompt": 3, "answer": "1"}]))},
     "row 1 key 'prompt': the prompt is neither a string nor a list of {role, content} messages"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [
        {"prompt": [{"role": "user", "content": "a"}], "answer": "1"},
        {"prompt": [{"role": "wizard", "content": "b"}], "answer": "1"}]))},
     "a.jsonl row 2 key 'prompt': unknown role 'wizard'"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"question": "q", "answer": "1"}])),
                "reward": "mathh"}, "env.reward names an unknown reward 'mathh'"),
    (lambda d: {"train": str(write_jsonl(d / "a.jsonl", [{"question": "q", "answer": "1"}])),
                "answer_key": "reward_model.ground_truth"},
     "no column for env.answer_key=reward_model.ground_truth"),
    (lambda d: {"train": [{"path": "x.jsonl", "weight": -1}]}, "env.train[0].weight must be"),
])
def test_bad_input_is_one_line_naming_file_row_and_key(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(EnvConfigError) as info:
        DatasetSpec(**make(tmp_path))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_eval_file_alone_is_for_evaluating_a_run_needs_train(tmp_path: Path) -> None:
    """``env.eval`` without ``env.train`` makes an environment to evaluate on (python -m
    orchestrator.eval); training on it is refused in one line before anything is built."""
    from orchestrator.builders import run
    from orchestrator.errors import ConfigError

    test = write_jsonl(tmp_path / "test.jsonl", [{"question": "12+13=", "answer": "25"}] * 3)
    spec = DatasetSpec(eval=str(test), reward="exact")
    assert len(spec.tasks("train")) == 0 and len(spec.tasks("eval")) == 3
    with pytest.raises(EnvConfigError, match=r"env.train \(or, to evaluate only, env.eval\)"):
        DatasetSpec()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smoke", "logger=none", "progress=false",
                                           "model.device=cpu", "env=dataset", f"env.eval={test}"])
    with pytest.raises(ConfigError, match="has no train tasks: a run needs them") as info:
        run(cfg, tmp_path / "run")
    assert "\n" not in str(info.value) and not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_from_a_file_end_to_end(tmp_path: Path) -> None:
    """The real config, the tiny model and its warm start, the math reward in workers; one
    prompt too long for the context is left out when the data is loaded."""
    from orchestrator.builders import run

    rows = [{"question": f"{a:02d}+{b:02d}=", "answer": str(a + b)}
            for a in range(0, 60, 7) for b in range(0, 60, 11)]
    rows.append({"question": "9" * 400 + "+1=", "answer": "1"})
    train = write_jsonl(tmp_path / "sums.jsonl", rows)
    test = write_jsonl(tmp_path / "test.jsonl", [{"question": "12+13=", "answer": "25"}] * 4)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[  # helpers.quick_config, less its env sizes
            "experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
            "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
            "pipeline.num_steps=2", "pipeline.batch_size=8", "pipeline.num_workers=2",
            "warmstart.steps=2", "warmstart.target_accuracy=null", "eval.num_tasks=4",
            "env=dataset", f"env.train={train}", f"env.eval={test}", "rollout.max_tokens=4",
            "env.reward={math: 1.0, format: 0.1}"])
    result = run(cfg, tmp_path / "run")
    assert len(result.reports) == 2 and result.eval_after is not None
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # episodes started from the file: two steps of 8, and those admitted ahead (k = 1)
    assert 16 <= metrics[1]["data/samples/sums"] <= 32
    assert metrics[1]["reward/timeouts"] == metrics[1]["reward/errors"] == 0
    assert 0.0 <= metrics[1]["reward/mean"] <= 1.1


# --- read exactly (issue 46: each of these failed at d79d362) -----------------------------------


def test_answers_keep_the_text_the_file_holds(tmp_path: Path) -> None:
    """At d79d362: '2.0' beside a 2.5, CSV 007 as '7', 20 digits as '1.2345678901234567e+19'."""
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text('{"question": "a", "answer": 2}\n{"question": "b", "answer": 2.50}\n'
                     '{"question": "c", "answer": 12345678901234567890}\n'
                     '{"question": "d", "answer": "x"}\n{"question": "e", "answer": -0.0}\n')
    assert [t.answer for t in DatasetSpec(train=str(jsonl)).tasks("train")] == \
        ["2", "2.50", "12345678901234567890", "x", "-0.0"]
    verl = write_jsonl(tmp_path / "verl.jsonl", verl_rows(2))
    verl.write_text(verl.read_text().replace('"ground_truth": "2"', '"ground_truth": 2.0')
                    .replace('"ground_truth": "0"', '"ground_truth": 7'))
    tasks = DatasetSpec(train=str(verl)).tasks("train")
    assert [t.answer for t in tasks] == ["7", "2.0"]
    assert tasks[0].metadata["reward_model"] == {"style": "rule", "ground_truth": "7"}
    array = tmp_path / "array.json"
    array.write_text('[\n {"question": "a",\n  "answer": 2},\n {"question": "b", "answer": 0.5}\n]')
    assert [t.answer for t in DatasetSpec(train=str(array)).tasks("train")] == ["2", "0.5"]
    csv = tmp_path / "codes.csv"
    csv.write_text("question,answer,n\nq,007,1\nq,12345678901234567890,2\nq,2.0,3\n")
    tasks = DatasetSpec(train=str(csv)).tasks("train")
    assert [t.answer for t in tasks] == ["007", "12345678901234567890", "2.0"]
    assert tasks[0].metadata["n"] == 1  # other columns keep their types


def test_a_conversation_ending_with_the_assistant_is_its_prompt_and_answer(tmp_path: Path) -> None:
    """TRL conversational rows: the last assistant turn is the reference answer, never part of
    the prompt (at d79d362: no answer column, or the answer inside the prompt)."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}, {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}])
    tasks = DatasetSpec(train=str(chat)).tasks("train")
    assert tasks[0].messages == tuple(turns[:2]) and tasks[0].answer == "4"
    assert tasks[1].messages[-1] == {"role": "user", "content": "3+3?"}
    assert tasks[1].answer == "6" and len(tasks[1].messages) == 3
    # with an answer column, the column is the answer and the assistant turn still leaves
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": turns, "answer": "four"}])
    task = DatasetSpec(train=str(both)).tasks("train")[0]
    assert task.messages == tuple(turns[:2]) and task.answer == "four"
    unanswered = write_jsonl(tmp_path / "open.jsonl", [{"messages": turns},
                                                       {"messages": turns[:2]}])
    with pytest.raises(EnvConfigError, match="row 2 key 'messages': no answer: the "
                       "conversation does not end with the assistant's turn"):
        DatasetSpec(train=str(unanswered))


def test_trl_prompt_completion_files_map(tmp_path: Path) -> None:
    """The completion is the reference answer (at d79d362: no answer column)."""
    plain = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": " 4"}])
    task = DatasetSpec(train=str(plain)).tasks("train")[0]
    assert task.messages == ({"role": "user", "content": "2+2="},) and task.answer == "4"
    chat = write_jsonl(tmp_path / "pc_chat.jsonl", [{
        "prompt": [{"role": "user", "content": "2+3?"}],
        "completion": [{"role": "assistant", "content": "5"}]}])
    task = DatasetSpec(train=str(chat)).tasks("train")[0]
    assert task.messages == ({"role": "user", "content": "2+3?"},) and task.answer == "5"


def test_lists_structs_and_booleans_reach_the_reward_as_they_are(tmp_path: Path) -> None:
    """``answer`` is the text the built-in rewards read (JSON for non-text); ``ground_truth``
    and the columns hold the value itself (at d79d362: 'the answer must be a string or a
    number')."""
    rows = [{"question": "a", "answer": [1, 2]}, {"question": "b", "answer": [3]}]
    tasks = DatasetSpec(train=str(write_jsonl(tmp_path / "lists.jsonl", rows))).tasks("train")
    assert tasks[0].answer == "[1, 2]" and tasks[0].ground_truth == [1, 2]
    assert tasks[0].metadata["answer"] == [1, 2]
    rows = [{"question": "a", "answer": True}, {"question": "b", "answer": False}]
    tasks = DatasetSpec(train=str(write_jsonl(tmp_path / "bools.jsonl", rows))).tasks("train")
    assert [t.answer for t in tasks] == ["true", "false"]
    assert [t.ground_truth for t in tasks] == [True, False]
    rows = [{"data_source": "s", "prompt": [{"role": "user", "content": "q"}],
             "reward_model": {"ground_truth": {"x": 1, "names": ["a"]}}}]
    task = DatasetSpec(train=str(write_jsonl(tmp_path / "verl.jsonl", rows))).tasks("train")[0]
    assert task.ground_truth == {"x": 1, "names": ["a"]}
    assert json.loads(task.answer) == {"x": 1, "names": ["a"]}


def _empty_files(d: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    (d / "empty.jsonl").write_text("")
    (d / "blank.jsonl").write_text("\n\n")
    (d / "empty.json").write_text("[]")
    (d / "empty.csv").write_text("")
    (d / "header.csv").write_text("question,answer\n")
    pq.write_table(pa.table({"question": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), d / "none.parquet")
    Dataset.from_dict({"question": [], "answer": []}).save_to_disk(str(d / "saved"))
    return [d / n for n in ("empty.jsonl", "blank.jsonl", "empty.json", "empty.csv",
                            "header.csv", "none.parquet", "saved")]


def test_empty_and_header_only_files_of_every_format_have_no_rows(tmp_path: Path) -> None:
    """At d79d362: StopIteration, 'corresponds to no data!', 'An error occurred while
    generating the dataset'."""
    for path in _empty_files(tmp_path):
        with pytest.raises(EnvConfigError) as info:
            DatasetSpec(train=str(path))
        assert str(info.value) == f"env.train: {path} has no rows"


def test_a_column_named_in_config_that_the_file_lacks_is_one_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", verl_rows(2))
    for keys, message in (
            ({"prompt_key": "question"}, "has no column for env.prompt_key=question"),
            ({"answer_key": "reward_model.answer"},
             "has no column for env.answer_key=reward_model.answer"),
            ({"answer_key": "solution"}, "has no column for env.answer_key=solution")):
        with pytest.raises(EnvConfigError) as info:
            DatasetSpec(train=str(path), **keys)
        assert str(info.value) == (f"env.train: {path} {message}; its columns: data_source, "
                                   "ability, prompt, reward_model, extra_info")


def test_a_file_is_read_once_into_the_cache_and_again_when_it_changes(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": 1}])
    first = DatasetSpec(train=str(path)).splits["train"]
    again = DatasetSpec(train=str(path)).splits["train"]
    files = [s.data.cache_files for s in (*first.segments(), *again.segments())]
    assert files[0] == files[1]
    import os
    write_jsonl(path, [{"question": "q", "answer": 1}, {"question": "r", "answer": 2}])
    os.utime(path, ns=(1, 1))
    assert [t.answer for t in DatasetSpec(train=str(path)).tasks("train")] == ["1", "2"]


def test_a_file_loads_without_holding_its_columns(tmp_path: Path) -> None:
    """A 48 MB verl-schema JSONL read as a run reads it (a child process, glibc set as a run
    sets it): it holds less than two thirds of the file after loading, on the first read and from
    the cache (at d79d362 whole columns were copied: about 1.5 times the file was held)."""
    from bench.dataset import measure_load, write_verl

    path = tmp_path / "verl.jsonl"
    rows = write_verl(path, 48)
    for _ in ("first", "cached"):
        figures = measure_load(path, tmp_path / "cache")
        assert figures["rows"] == rows
        assert figures["held"] < 32, figures
        assert figures["peak"] - figures["baseline"] < 48, figures


def test_a_file_read_in_chunks_keeps_one_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows: integer answers in the first, doubles in a later one, a column
    the later rows lack (null there); a column whose type changes is one line naming rows."""
    from envs import datafiles

    monkeypatch.setattr(datafiles, "CHUNK", 64)
    rows = [{"question": f"q{i}", "answer": i, "tag": "t"} for i in range(6)]
    rows += [{"question": f"r{i}", "answer": i + 0.5} for i in range(6)]
    tasks = DatasetSpec(train=str(write_jsonl(tmp_path / "a.jsonl", rows))).tasks("train")
    assert [t.answer for t in tasks] == [str(i) for i in range(6)] + \
        [f"{i + 0.5}" for i in range(6)]
    assert tasks[0].metadata["tag"] == "t" and tasks[11].metadata["tag"] is None
    rows = [{"question": "q", "answer": "1", "n": 1}] * 6 + [{"question": "q", "answer": "1",
                                                              "n": "one"}] * 6
    with pytest.raises(EnvConfigError, match=r"b.jsonl rows \d+-\d+ key 'n': string here, int64 "
                       "in the file's first rows; give the column one type"):
        DatasetSpec(train=str(write_jsonl(tmp_path / "b.jsonl", rows)))
