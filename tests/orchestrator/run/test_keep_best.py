"""``checkpoint.keep_best`` (orchestrator/run/best.py): the best checkpoint by an evaluation figure
is kept besides the latest, named in ``best.json`` and ``summary.json``, known after a resume, taken
by ``--step best``; an unknown figure stops the run before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import quick_config

from orchestrator.builders import run
from orchestrator.commands.export import export
from orchestrator.commands.targets import locate
from orchestrator.config.read import explain
from orchestrator.config.schema import EvalConfig
from orchestrator.errors import ConfigError
from orchestrator.pipeline.evaluation import score
from orchestrator.run.best import KeepBest
from orchestrator.run.checkpoint import Best, CheckpointStore
from orchestrator.run.resume import RunState
from orchestrator.types import EvalSample, Evaluation

METRIC = "eval/pass@1"


def scored(pass_rate: float, tasks: int = 10) -> Evaluation:
    """An evaluation of ``tasks`` tasks, one sample each, ``pass_rate`` of them correct."""
    samples = [EvalSample(task_id=t, sample_index=0, source="a", reward=float(t < pass_rate * tasks),
                          tokens=3, answer=None) for t in range(tasks)]
    return score(samples, EvalConfig())


def save(store: CheckpointStore, step: int) -> None:
    store.save(step, lambda d: (d / "weights").write_text(str(step)))


def test_the_best_is_kept_besides_the_latest_and_a_tie_keeps_the_earlier(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    best = KeepBest(METRIC, store)
    for step, rate in enumerate([0.2, 0.5, 0.5, 0.1]):
        save(store, step)
        best.offer(step, scored(rate))
        store.prune()
    assert store.steps() == [1, 3]  # the best (step 1; step 2 only tied it) and the latest
    assert store.best() == Best(step=1, metric=METRIC, value=0.5)
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 1
    assert best.summary() == {"path": "checkpoints/step-1", "step": 1, "metric": METRIC,
                              "value": 0.5}
    save(store, 4)
    best.offer(4, scored(0.9))  # a better one: the old best goes at the next prune
    store.prune()
    assert store.steps() == [4] and store.best() == Best(4, METRIC, 0.9)


def test_a_checkpoint_waiting_for_its_evaluation_is_held(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    best = KeepBest(METRIC, store)
    best.expect(1)  # an evaluation began with step 1's weights
    for step in range(1, 5):  # newer checkpoints are written while it runs
        save(store, step)
    assert store.steps() == [1, 4]
    best.offer(1, scored(0.3))
    store.prune()
    assert store.steps() == [1, 4] and store.best() == Best(1, METRIC, 0.3)
    best.expect(5)
    save(store, 5)
    save(store, 6)
    best.offer(6, scored(0.0))  # step 5's evaluation was skipped: let go with later ones
    store.prune()
    assert store.steps() == [1, 6]


def test_a_resumed_run_keeps_its_checkpoints_view_of_the_best(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    for step in range(7):
        save(store, step)
    store.set_best(Best(6, METRIC, 0.9))  # scored after the checkpoint resumed from (step 3)
    kept = KeepBest(METRIC, store, best=Best(2, METRIC, 0.4), resumed_at=3)
    assert kept.best == Best(2, METRIC, 0.4) and store.best() == kept.best  # 6 is trained again
    store.set_best(Best(3, METRIC, 0.8))  # scored after the checkpoint was written, not redone
    assert KeepBest(METRIC, store, best=Best(2, METRIC, 0.4), resumed_at=3).best == \
        Best(3, METRIC, 0.8)
    # another metric's best does not count; a fresh run forgets one left in the directory
    assert KeepBest("eval/accuracy", store, best=Best(2, METRIC, 0.4), resumed_at=3).best is None
    store.set_best(Best(2, METRIC, 0.4))
    KeepBest(METRIC, store)
    assert store.best() is None and not (tmp_path / "best.json").exists()


def test_figures_it_ranks_by_and_one_line_for_another() -> None:
    config = EvalConfig(n=4, k=[1, 4])
    assert config.ranked_figures(["gsm8k"]) == [
        "eval/accuracy", "eval/mean@4", "eval/pass@1", "eval/pass@4", "eval/maj@4",
        "eval/gsm8k/mean@4", "eval/gsm8k/pass@1", "eval/gsm8k/pass@4", "eval/gsm8k/maj@4"]
    for bad in ("eval/pass@2", "eval/std@4", "eval/response_tokens", "pass@1", "eval/math/pass@1"):
        with pytest.raises(ConfigError) as error:
            config.check_ranked_figure(bad, ["gsm8k"])
        assert str(error.value).startswith(f"checkpoint.keep_best={bad} is not a figure")
        assert "\n" not in str(error.value) and "eval/pass@4" in str(error.value)
    evaluation = scored(0.3)
    assert evaluation.figure("eval/accuracy") == evaluation.figure("eval/mean@1") == 0.3
    assert evaluation.figure("eval/a/pass@1") == 0.3 and evaluation.figure("eval/maj@1") is None


def test_step_best_of_a_run_that_kept_none_is_one_line(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="has no best checkpoint \\(start the run with "
                                          "checkpoint.keep_best=<metric>"):
        locate(tmp_path, "best")
    from orchestrator.commands.export import main

    assert main([str(tmp_path), "--step", "best", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --step best: ") and err.count("\n") == 1


@pytest.mark.parametrize(("override", "message"), [
    ("checkpoint.keep_best=eval/pass@8", "checkpoint.keep_best=eval/pass@8 is not a figure"),
    ("checkpoint.keep_best=eval/gsm8k/mean@1", "for a data source of the eval tasks (arithmetic)"),
])
def test_an_unknown_figure_stops_the_run_before_anything_is_built(
        tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        run(quick_config("smoke", override), tmp_path / "run")
    assert explain(e.value) is not None and "\n" not in explain(e.value)  # type: ignore[operator]
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
    with pytest.raises(ConfigError, match="eval.num_tasks=0 runs none"):
        run(quick_config("smoke", "checkpoint.keep_best=eval/accuracy", "eval.num_tasks=0"),
            tmp_path / "run")


def test_a_run_keeps_its_best_across_a_resume(tmp_path: Path) -> None:
    cfg = quick_config("smoke", "checkpoint.every=1", "checkpoint.keep=2", "eval.every=1",
                       f"checkpoint.keep_best={METRIC}", "pipeline.num_steps=4",
                       "warmstart.steps=12", "warmstart.lr=3e-3")
    first = run(cfg, tmp_path)
    store = CheckpointStore(tmp_path / "checkpoints")
    best = store.best()
    assert best is not None and best.metric == METRIC
    assert first.summary["best_checkpoint"] == {
        "path": f"checkpoints/step-{best.step}", "step": best.step, "metric": METRIC,
        "value": best.value}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_checkpoint"] == first.summary["best_checkpoint"]
    steps = store.steps()
    assert steps[-2:] == [3, 4] and set(steps) <= {best.step, 3, 4}  # the latest and the best
    evaluations = [first.eval_before] + [r.evaluation for r in first.reports if r.evaluation]
    values = [e.figure(METRIC) for e in [*evaluations, first.eval_after] if e is not None]
    assert best.value == max(values)  # it is the highest the run saw

    # resumed from the checkpoint of step 3: the best so far is known and still kept
    resume_from = store.path(3)
    state = RunState.read(resume_from)
    assert state.best is not None and state.best.metric == METRIC
    again = run(cfg, tmp_path, resume_from=resume_from)
    kept = CheckpointStore(tmp_path / "checkpoints").best()
    assert kept is not None and kept.value >= state.best.value
    assert again.summary["best_checkpoint"]["step"] == kept.step
    assert (tmp_path / "checkpoints" / f"step-{kept.step}").is_dir()

    # --step best: the export and (tests/orchestrator/commands/test_eval_command.py) the evaluation
    assert locate(tmp_path, "best").path == tmp_path / "checkpoints" / f"step-{kept.step}"
    out = export(tmp_path, tmp_path / "hf", step="best")
    assert (out / "model.safetensors").is_file()
