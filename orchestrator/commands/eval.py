"""``python -m orchestrator.eval TARGET [--step N|best] [-o PATH] [key=value …]``: one
evaluation of a checkpoint or a model, as a run evaluates (:mod:`orchestrator.pipeline.evaluation`).

TARGET (:mod:`orchestrator.commands.targets`) is a run directory (its latest checkpoint; ``--step
N`` for ``checkpoints/step-N``, ``--step best`` for the one ``checkpoint.keep_best`` kept), a
checkpoint directory of a run, or a Hugging Face model directory
(``orchestrator.commands.export``'s, or any ``save_pretrained`` one).

The config. For a run's checkpoint it is the run's own ``config.yaml``: the same environment,
data, rollout limits and evaluation settings; the model is the run's, with the checkpoint's
weights (LoRA adapters merged). For a model directory it is composed from ``conf/`` like a
run's, with ``model=hf model.path=TARGET`` (``model.dtype`` defaults to bfloat16 as for
``model=hf``). Either way ``key=value`` overrides follow, as on ``python -m orchestrator``'s
command line (:func:`orchestrator.config.read.apply_overrides`): ``engine=vllm``, ``env=dataset
env.eval=my.parquet``, ``eval.n=16 eval.temperature=0.7 eval.k=[1,4,16]``,
``eval.num_tasks=500``. ``model=`` is refused: the target is the model.

The parts are the run's own: the environment, tokenizer and dataset length check
(:func:`orchestrator.builders.environment`), the engine recipe
(:func:`orchestrator.builders.engine_of`, built in this process; ``launcher`` is not used), the
model from the checkpoint (:func:`orchestrator.commands.targets.load`), and
:func:`orchestrator.pipeline.evaluation.evaluate`.

Output: a table per data source and over all tasks on stdout, each figure as ``value ± se``
(its standard error over tasks, :mod:`orchestrator.pipeline.evaluation`), and two files per
evaluation, each under its own name: ``eval-<UTC time>[-step-N].json`` (the typed
:class:`~orchestrator.types.Evaluation` with its standard errors, what was evaluated, a few
example samples per source, the wall time and tokens/s) and beside it the same name ending
``.samples.jsonl``, every generation (source, task id, the row it was read from, sample index,
reply, answer, its maj@n group, reward, reference), in ``evals/`` of the run directory (a run
or checkpoint target) or of the model directory; ``-o PATH`` names the JSON file instead. The
last line is ``eval_mean=<mean@n> pass_at_<k>=<pass@k>`` for the largest k. Progress goes to
stderr: a bar on a terminal, else a line every 10 seconds (``progress=false``: none).

Bad input is one line (``error: …``, exit code 2): a TARGET that is none of the three kinds,
a k larger than n, a step with no checkpoint, an unknown key, a model directory with no
tokenizer. A directory with a ``config.json`` (a Hugging Face model) is a model directory even
when it also holds a ``config.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
from omegaconf import DictConfig, OmegaConf

from orchestrator.builders import (
    engine_of,
    environment,
    eval_tasks_of,
    served_judge,
    torch_settings,
)
from orchestrator.commands.targets import (
    CONFIG,
    Checkpoint,
    Step,
    is_checkpoint,
    is_model_dir,
    is_run_dir,
    load,
    locate,
    parse_step,
    step_of,
)
from orchestrator.config.read import CONF, apply_overrides, register_plugin_envs, report, scalar
from orchestrator.config.run import run_config
from orchestrator.engines.placement import Placement
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.run.directory import write_json, write_jsonl
from orchestrator.trace.recorder import Recorder
from orchestrator.types import EvalSample, Evaluation
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)

EVALS = "evals"  # each evaluation's files, in the run's or the model's directory
SAMPLES_SUFFIX = ".samples.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Target:
    """What TARGET names: a run's checkpoint, or a Hugging Face model directory."""

    given: Path
    checkpoint: Checkpoint | None = None
    model_dir: Path | None = None

    def default_out(self, now: float | None = None) -> Path:
        """Where an evaluation's JSON goes without ``-o``: a new name in ``evals/`` of the
        run's directory, or the model's (``eval-<UTC time>[-step-N].json``)."""
        directory = self.checkpoint.run_dir if self.checkpoint is not None else self.model_dir
        assert directory is not None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        step = None if self.checkpoint is None else step_of(self.checkpoint)
        stem = f"eval-{stamp}" + ("" if step is None else f"-step-{step}")
        path, count = directory / EVALS / f"{stem}.json", 1
        while path.exists() or samples_path(path).exists():  # never another's name
            count += 1
            path = directory / EVALS / f"{stem}-{count}.json"
        return path


def samples_path(path: Path) -> Path:
    """The samples file beside an evaluation's JSON file ``path``."""
    return path.with_name(path.name.removesuffix(".json") + SAMPLES_SUFFIX)


def resolve(target: str | Path, step: Step = None) -> Target:
    """The checkpoint or model directory ``target`` names; one line if none."""
    path = Path(target)
    if is_run_dir(path) or is_checkpoint(path) or (
            (path / CONFIG).is_file() and not is_model_dir(path)):
        return Target(path, checkpoint=locate(path, step))
    if is_model_dir(path):
        if step is not None:
            raise ConfigError(f"--step {step} picks a checkpoint of a run directory, but {path} "
                              "is a Hugging Face model directory: drop --step")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"{path} has a model but no tokenizer (none of "
                              f"{', '.join(TOKENIZER_FILES)}): save it beside the weights "
                              "(tokenizer.save_pretrained) or evaluate python -m "
                              "orchestrator.commands.export's directory, which has one")
        return Target(path, model_dir=path)
    raise ConfigError(f"{path} is none of a run directory ({CONFIG} and checkpoints/), a "
                      "checkpoint directory (<run_dir>/checkpoints/step-N or final) or a Hugging "
                      "Face model directory (config.json)")


def target_config(target: Target, overrides: Sequence[str]) -> DictConfig:
    """The run's own config (or ``conf/`` with ``model=hf model.path=TARGET``) with
    ``overrides`` applied."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key == "model" or key == "model.path" or key == "model.gguf":
            raise ConfigError(f"{override}: the model is the target's ({target.given}); "
                              "give another TARGET to evaluate another model")
        if key == "experiment" and target.checkpoint is not None:
            raise ConfigError(f"{override}: a run's checkpoint is evaluated with the run's own "
                              "config; override its keys instead (env=…, eval.n=…)")
    if target.checkpoint is not None:
        cfg = OmegaConf.load(target.checkpoint.run_dir / CONFIG)
        assert isinstance(cfg, DictConfig)
        return apply_overrides(cfg, overrides)
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["model=hf", *overrides])
    assert target.model_dir is not None
    OmegaConf.update(cfg, "model.path", str(target.model_dir.absolute()))
    return cfg


def checkpoint_weights(checkpoint: Checkpoint) -> WeightUpdate:
    """The checkpoint's weights (a LoRA run's merged into the base), stamped with its step."""
    _, model, lora = load(checkpoint)
    if lora is not None:
        model = model.merge_and_unload()  # type: ignore[operator]
    return WeightUpdate.by_reference(step_of(checkpoint) or 0, model.state_dict(), leased=False)


@dataclass(frozen=True)
class Outcome:
    evaluation: Evaluation
    seconds: float  # the evaluation itself, engine start-up excluded
    tokens: int  # generated

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def run_evaluation(target: Target, cfg: DictConfig, progress: bool = False) -> Outcome:
    """Build the run's parts from ``cfg`` and evaluate ``target``'s weights (``progress``: on
    stderr, :class:`Progress`)."""
    config = run_config(cfg)
    torch_settings(config)
    rollout_cfg, eval_cfg = config.rollout, config.eval
    spec, tokenizer = environment(config)
    tasks = eval_tasks_of(spec, eval_cfg)
    if not tasks:
        raise ConfigError("nothing to evaluate: eval.num_tasks is 0 or the environment has no "
                          "eval tasks; set eval.num_tasks > 0")
    # no trainer beside it: the starting weights go by the byte route, the engine takes its GPU
    recipe = replace(engine_of(config), placement=Placement(trainer_here=False))
    weights = checkpoint_weights(target.checkpoint) if target.checkpoint is not None else None
    judge = served_judge(config, spec)  # env.judge.serve: the judge's model, served in this run

    async def session(on_sample: Callable[[EvalSample], None] | None) -> Outcome:
        recorder = Recorder()
        async with (judge() if judge is not None else nullcontext()), spec.running(), \
                recipe.build(weights) as engine:
            runner = EpisodeRunner(engine, tokenizer, spec, rollout_cfg, recorder)
            started = time.perf_counter()
            evaluation = await evaluate(runner, tasks, eval_cfg, on_sample)
            seconds = time.perf_counter() - started
        return Outcome(evaluation, seconds, round(evaluation.overall.response_tokens
                                                  * evaluation.overall.samples))

    bar = Progress(len(tasks) * eval_cfg.n) if progress else None
    try:
        return anyio.run(session, bar, backend="asyncio")  # vLLM's engine runs on asyncio
    finally:
        if bar is not None:
            bar.close()


# -- output -----------------------------------------------------------------------------------


def table(evaluation: Evaluation) -> str:
    """A row per data source and one over all tasks: tasks, samples, every figure."""
    rows = [(source, scores) for source, scores in sorted(evaluation.sources.items())]
    rows.append(("all", evaluation.overall))
    figures = list(evaluation.overall.metrics(evaluation.n))
    header = ["source", "tasks", "samples", *figures]
    lines = [[name, str(s.tasks), str(s.samples),
              *(_cell(s.metrics(evaluation.n).get(f), s.errors(evaluation.n).get(f))
                for f in figures)] for name, s in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in [header, *lines])


def _cell(value: float | None, se: float | None) -> str:
    """``value ± se`` (a response length to one decimal)."""
    if value is None:
        return "-"
    digits = 1 if value >= 10 else 3
    return f"{value:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")


def last_line(evaluation: Evaluation) -> str:
    """``eval_mean=<mean@n> pass_at_<k>=<pass@k>`` for the largest k."""
    k = max(evaluation.overall.pass_at)
    return f"eval_mean={evaluation.mean:.4f} pass_at_{k}={evaluation.overall.pass_at[k]:.4f}"


def record(target: Target, cfg: DictConfig, outcome: Outcome,
           samples_file: Path | None = None) -> dict[str, Any]:
    """An evaluation's JSON: what was evaluated, how, and the evaluation (with its standard
    errors under each scope's ``se``)."""
    checkpoint = target.checkpoint
    evaluation = outcome.evaluation
    return {
        "target": str(target.given),
        "run_dir": None if checkpoint is None else str(checkpoint.run_dir),
        "checkpoint": None if checkpoint is None else str(checkpoint.path),
        "step": None if checkpoint is None else step_of(checkpoint),
        "model_dir": None if target.model_dir is None else str(target.model_dir),
        "env": OmegaConf.select(cfg, "env._target_"),
        "engine": OmegaConf.select(cfg, "engine._target_"),
        "eval": OmegaConf.to_container(cfg.eval, resolve=True),
        "seconds": outcome.seconds,
        "tokens_per_s": outcome.tokens_per_s,
        "evaluation": evaluation.to_dict(),
        "samples_file": None if samples_file is None else str(samples_file),
        "examples": [{"source": s.source, "task_id": s.task_id, "sample": s.sample_index,
                      "prompt": s.prompt, "completion": s.completion, "reward": s.reward,
                      "answer": s.answer, "reference": s.reference}
                     for s in evaluation.examples],
    }


def sample_lines(evaluation: Evaluation) -> list[dict[str, Any]]:
    """The samples file's lines: every generation of the evaluation."""
    return [{"source": s.source, "task_id": s.task_id, "origin": s.origin,
             "sample": s.sample_index, "reward": s.reward, "answer": s.answer, "vote": s.vote,
             "reference": s.reference, "tokens": s.tokens, "reply": s.reply,
             "prompt": s.prompt, "completion": s.completion} for s in evaluation.samples]


class Progress:
    """Samples done of ``total``, on stderr: a bar on a terminal, else a line every
    ``interval`` seconds and one at the end."""

    def __init__(self, total: int, interval: float = 10.0) -> None:
        self.total, self.done, self.interval = total, 0, interval
        self._started = self._last = time.monotonic()
        self._bar: Any = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar("eval", BarColumn(), MofNCompleteColumn(), "samples",
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("eval", total=total)
            self._bar.start()

    def __call__(self, sample: EvalSample) -> None:
        self.done += 1
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif now - self._last >= self.interval or self.done == self.total:
            self._last = now
            rate = self.done / max(now - self._started, 1e-9)
            left = (self.total - self.done) / max(rate, 1e-9)
            print(f"eval: {self.done}/{self.total} samples, {rate:.1f}/s, {left:.0f}s left",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def evaluate_target(target: str | Path, overrides: Sequence[str] = (), step: Step = None,
                    out: str | Path | None = None) -> tuple[Outcome, Path]:
    """Evaluate TARGET (see the module's docstring); the outcome and where its JSON went (its
    samples file beside it, :func:`samples_path`)."""
    resolved = resolve(target, step)
    cfg = target_config(resolved, overrides)
    outcome = run_evaluation(resolved, cfg, progress=scalar(cfg, "progress"))
    path = Path(out) if out is not None else resolved.default_out()
    samples = samples_path(path)
    write_jsonl(samples, sample_lines(outcome.evaluation))
    write_json(path, record(resolved, cfg, outcome, samples))
    return outcome, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.eval",
        description="Evaluate a run's checkpoint or a Hugging Face model directory on the "
                    "held-out tasks, as a run does (docs/evaluation.md).",
        epilog="Each evaluation is written under its own name in evals/ of the run directory "
               "(TARGET a run or one of its checkpoints) or the model directory (-o PATH: that "
               "JSON file), every generation beside it in <name>.samples.jsonl. Figures are "
               "value ± standard error. The last line is eval_mean=<mean@n> "
               "pass_at_<k>=<pass@k> for the largest k.")
    parser.add_argument("target", metavar="TARGET",
                        help="a run directory (its latest checkpoint), a checkpoint directory "
                             "(<run_dir>/checkpoints/step-N or final) or a Hugging Face model "
                             "directory")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides on the run's config (or conf/ for a model "
                             "directory): engine=vllm, env=…, eval.n=16, eval.k=[1,4,16], …")
    parser.add_argument("--step", metavar="N|best",
                        help="the run's checkpoint of step N, or the best one "
                             "(checkpoint.keep_best)")
    parser.add_argument("-o", "--out", metavar="PATH",
                        help="the evaluation's JSON file (its samples beside it)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] - %(message)s")
    register_plugin_envs()
    try:
        for override in args.overrides:
            if "=" not in override:
                raise ConfigError(f"{override} is not a key=value override")
        step = None if args.step is None else parse_step(args.step)
        outcome, path = evaluate_target(args.target, args.overrides, step, args.out)
    except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001 - re-raised unless explained
        return report(error)
    evaluation = outcome.evaluation
    print(table(evaluation))
    print(f"{evaluation.overall.samples} samples in {outcome.seconds:.1f}s "
          f"({outcome.tokens_per_s:.0f} tokens/s); {path}")
    print(last_line(evaluation))
    return 0


if __name__ == "__main__":
    from orchestrator.allocator import keep_freed_memory

    keep_freed_memory()  # before any other thread allocates (see orchestrator.allocator)
    sys.exit(main())
