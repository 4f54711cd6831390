"""``python -m orchestrator.eval``: a run directory, one of its checkpoints (``--step N``,
``--step best``) and its export as a Hugging Face directory evaluate as the run's own
evaluation does, with the run's parts; bad input in one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
from helpers import REPO, quick_config

from orchestrator.builders import run
from orchestrator.commands.eval import evaluate_target, last_line, main, samples_path, table
from orchestrator.commands.export import export
from orchestrator.run.checkpoint import CheckpointStore

# the run's eval tasks and rollout limits, for a model directory composed from conf/
AS_THE_RUN = ["experiment=smoke", "model.dtype=float32", "model.device=cpu", "env.train_size=32",
              "env.eval_size=4", "eval.num_tasks=4", "progress=false", "logger=none"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run, warm-started until it answers in digits, that keeps its best checkpoint."""
    path = tmp_path_factory.mktemp("run")
    run(quick_config("smoke", "checkpoint.every=1", "checkpoint.keep=2",
                     "checkpoint.keep_best=eval/accuracy", "warmstart.steps=12",
                     "warmstart.lr=3e-3"), path)
    return path


def completions(path: Path) -> list[tuple[int, str]]:
    return [(e["task_id"], e["completion"]) for e in json.loads(path.read_text())["examples"]]


def test_a_run_its_checkpoint_and_its_export_evaluate_alike(run_dir: Path, tmp_path: Path) -> None:
    # the run directory: its latest checkpoint (final), greedy, the run's eval settings
    outcome, path = evaluate_target(run_dir)
    assert path.parent == run_dir / "evals" and path.name.startswith("eval-")
    written = json.loads(path.read_text())
    # every generation kept beside it, with its answer, maj@n group, reward and task
    kept = [json.loads(line) for line in samples_path(path).read_text().splitlines()]
    assert written["samples_file"] == str(samples_path(path)) and len(kept) == 4
    assert {k["task_id"] for k in kept} == {s["task_id"] for s in written["examples"]}
    assert all({"reply", "answer", "vote", "reward", "origin", "sample"} <= set(k) for k in kept)
    # a second evaluation is written under its own name: the first stays
    again, second = evaluate_target(run_dir)
    assert second != path and path.is_file() and samples_path(second).is_file()
    assert again.evaluation.overall == outcome.evaluation.overall
    assert written["checkpoint"] == str(run_dir / "checkpoints" / "final")
    assert written["evaluation"]["n"] == 1 and written["evaluation"]["overall"]["tasks"] == 4
    after = json.loads((run_dir / "summary.json").read_text())["eval_after"]
    assert outcome.evaluation.mean == after  # the run's own evaluation after RL, again

    # a checkpoint directory, and --step N of the run: the same weights
    step = CheckpointStore(run_dir / "checkpoints").steps()[-1]
    by_dir, _ = evaluate_target(run_dir / "checkpoints" / f"step-{step}", out=tmp_path / "a.json")
    by_step, _ = evaluate_target(run_dir, step=step, out=tmp_path / "b.json")
    assert completions(tmp_path / "a.json") == completions(tmp_path / "b.json")
    assert by_dir.evaluation.overall == by_step.evaluation.overall
    assert json.loads((tmp_path / "b.json").read_text())["step"] == step

    # its export: a Hugging Face directory composed from conf/ as the run was
    hf = export(run_dir, tmp_path / "hf")
    from_hf, hf_path = evaluate_target(hf, AS_THE_RUN)
    assert hf_path.parent == hf / "evals"
    assert from_hf.evaluation.overall == outcome.evaluation.overall
    assert completions(hf_path) == completions(path)
    assert any(c.strip() for _, c in completions(hf_path))  # it answers something

    # n samples at a temperature, pass@k for each k, through the same engine
    sampled, _ = evaluate_target(run_dir, ["eval.n=4", "eval.temperature=1.0", "eval.k=[1,2,4]",
                                           "engine.max_batch_size=8"], out=tmp_path / "c.json")
    overall = sampled.evaluation.overall
    assert overall.samples == 16 and set(overall.pass_at) == {1, 2, 4}
    assert overall.pass_at[1] <= overall.pass_at[2] <= overall.pass_at[4]
    lines = table(sampled.evaluation).splitlines()
    assert lines[0].split()[:5] == ["source", "tasks", "samples", "mean@4", "std@4"]
    assert [line.split()[0] for line in lines[1:]] == ["arithmetic", "all"]
    figures = len(lines[0].split()) - 3
    assert all(line.count(" ± ") == figures for line in lines[1:])  # every figure ± its se
    se = json.loads((tmp_path / "c.json").read_text())["evaluation"]["overall"]["se"]
    assert set(se) == set(overall.metrics(4)) and se["pass@4"] >= 0
    assert last_line(sampled.evaluation) == \
        f"eval_mean={overall.mean:.4f} pass_at_4={overall.pass_at[4]:.4f}"


def test_step_best_is_the_checkpoint_the_run_kept(run_dir: Path, tmp_path: Path) -> None:
    best = CheckpointStore(run_dir / "checkpoints").best()
    assert best is not None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_checkpoint"]["step"] == best.step
    _, path = evaluate_target(run_dir, step="best", out=tmp_path / "best.json")
    written = json.loads(path.read_text())
    assert written["checkpoint"] == str(run_dir / "checkpoints" / f"step-{best.step}")
    assert written["evaluation"]["overall"]["mean@1"] == best.value  # as the run scored it


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``main(argv)`` fails with exit code 2 and one line on stderr, which it returns."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line(run_dir: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert "is none of a run directory (config.yaml and checkpoints/), a checkpoint directory" \
        in bad(capsys, str(tmp_path))
    assert "is none of" in bad(capsys, str(run_dir / "config.yaml"))
    assert "eval.k=[1, 8] has k=8: each k must be a whole number from 1 to eval.n=4" in \
        bad(capsys, str(run_dir), "eval.n=4", "eval.k=[1,8]")
    assert "unknown config key 'eval.nn'" in bad(capsys, str(run_dir), "eval.nn=4")
    assert "no checkpoint of step 99" in bad(capsys, str(run_dir), "--step", "99")
    assert "--step last must be a step number or best" in bad(capsys, str(run_dir), "--step", "last")
    assert "model=tiny: the model is the target's" in bad(capsys, str(run_dir), "model=tiny")
    assert "unknown engine 'nope'" in bad(capsys, str(run_dir), "engine=nope")
    hf = export(run_dir, tmp_path / "hf")
    assert "is a Hugging Face model directory: drop --step" in bad(capsys, str(hf), "--step", "1")
    # a model directory that also holds a config.yaml (of the user's) is still a model
    # directory, not a run's; one without a tokenizer is one line, not a traceback
    (hf / "config.yaml").write_text("notes: mine\n")
    assert "is a Hugging Face model directory: drop --step" in bad(capsys, str(hf), "--step", "1")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
        (hf / name).unlink(missing_ok=True)
    assert "has a model but no tokenizer" in bad(capsys, str(hf))


def test_the_command_line(run_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    out = tmp_path / "eval.json"
    done = forked.run([sys.executable, "-m", "orchestrator.eval", str(run_dir), "eval.n=2",
                       "eval.temperature=1.0", "progress=true", "-o", str(out)], cwd=REPO, env=env,
                      capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    evaluation = json.loads(out.read_text())["evaluation"]["overall"]
    assert lines[-1] == f"eval_mean={evaluation['mean@2']:.4f} pass_at_2={evaluation['pass@2']:.4f}"
    assert lines[0].split()[0] == "source" and "eval: 8/8 samples" in done.stderr
    figures = len(lines[0].split()) - 3
    rows = [line for line in lines[1:] if line.split()[0] in ("arithmetic", "all")]
    assert len(rows) == 2 and all(row.count(" ± ") == figures for row in rows)
    assert (tmp_path / "eval.samples.jsonl").is_file()


def test_evaluation_without_a_train_file_draws_tasks_per_source(run_dir: Path,
                                                                tmp_path: Path) -> None:
    # two eval files and no train file: eval.num_tasks of each, drawn with eval.seed; the
    # first N rows (as before) never reached the second file
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    for path, base in ((first, 10), (second, 50)):
        path.write_text("".join(json.dumps({"prompt": f"{base + i}+0=", "answer": str(base + i)})
                                + "\n" for i in range(6)))
    hf = export(run_dir, tmp_path / "hf")
    args = [*(a for a in AS_THE_RUN if not a.startswith(("env.", "eval."))), "env=dataset",
            f"env.eval=[{first},{second}]", "env.reward=exact", "eval.num_tasks=3",
            "eval.max_tokens=3"]
    outcome, path = evaluate_target(hf, args)
    evaluation = outcome.evaluation
    assert {s: v.tasks for s, v in evaluation.sources.items()} == {"first": 3, "second": 3}
    kept = [json.loads(line) for line in samples_path(path).read_text().splitlines()]
    rows = sorted(k["origin"] for k in kept)
    assert rows != sorted(f"{f}:{r}" for f in (first, second) for r in (1, 2, 3))  # drawn
    assert all(k["tokens"] <= 3 for k in kept)  # eval.max_tokens, not rollout.max_tokens
    evaluate_target(hf, args, out=tmp_path / "again.json")
    assert sorted(k["origin"] for k in map(json.loads, samples_path(tmp_path / "again.json")
                                           .read_text().splitlines())) == rows  # seeded
    evaluate_target(hf, [*args, "eval.seed=1"], out=tmp_path / "other.json")
    assert sorted(k["origin"] for k in map(json.loads, samples_path(tmp_path / "other.json")
                                           .read_text().splitlines())) != rows
