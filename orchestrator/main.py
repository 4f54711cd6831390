"""One training run from a composed config: ``run(cfg)``.

Builds the policy, environment, algorithm, trainer and engine the config names, runs the
supervised warm start, then the asynchronous RL pipeline, and leaves everything in the run
directory: ``config.yaml`` (resolved), ``metrics.jsonl``, ``spans.jsonl``, ``summary.json``,
``checkpoints/final/``, the PolyTrace files of every trained step
(``multiturn_workload_step_N.jsonl``, ``reward_timings_step_N.jsonl``,
``packed_lengths_step_N.jsonl``; see :mod:`orchestrator.trace.writer`), the Perfetto
timeline ``timeline.json`` and, with the W&B logger, ``wandb/``. The spans, trace files and
metrics are written even when the run fails part-way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from envs.base import EnvSpec, Task
from orchestrator.algo.base import Algorithm
from orchestrator.checkpoint import save_checkpoint
from orchestrator.config import build_env, check_target, scalar, typed
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.evaluate import evaluate
from orchestrator.loggers.base import JsonlMetrics, Logger
from orchestrator.loggers.progress import StepProgress
from orchestrator.models.policy import Policy
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.pipeline import Pipeline, PipelineConfig, StepReport, TaskSampler
from orchestrator.recorder import Recorder
from orchestrator.rollout import RolloutConfig
from orchestrator.trace.timeline import write_timeline
from orchestrator.trace.writer import TraceWriter
from orchestrator.trainer import Trainer
from orchestrator.warmstart import WarmStartConfig, warm_start

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    reports: list[StepReport]
    warm_start_steps: int = 0
    eval_before: float | None = None
    eval_after: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def check_sizes(pipeline: PipelineConfig, rollout: RolloutConfig, spec: EnvSpec) -> None:
    rollout.validate()
    pipeline.validate(rollout.group_size)
    prompts = pipeline.batch_size // rollout.group_size
    train = len(spec.tasks("train"))
    if prompts > train:
        raise ConfigError(
            f"pipeline.batch_size={pipeline.batch_size} needs {prompts} prompts per step "
            f"(group size {rollout.group_size}) but the environment has only {train} train tasks"
        )


@dataclass(frozen=True)
class EvalConfig:
    num_tasks: int = 200  # greedy episodes on the eval split before and after RL (0: skip)

    def validate(self) -> None:
        if self.num_tasks < 0:
            raise ConfigError(f"eval.num_tasks must be >= 0, got {self.num_tasks}")


def run(cfg: DictConfig, run_dir: Path) -> RunResult:
    """Run the experiment ``cfg`` describes; raises :class:`ConfigError` on bad input."""
    if OmegaConf.select(cfg, "replay") is not None:  # experiment=replay: no model, virtual time
        from orchestrator.engines.replay_run import run_replay

        return run_replay(cfg, run_dir)
    seed: int = scalar(cfg, "seed", int)
    threads: int | None = scalar(cfg, "torch_threads", int | None)
    progress: bool = scalar(cfg, "progress", bool)
    pipeline_cfg = typed(PipelineConfig, cfg, "pipeline")
    rollout_cfg = typed(RolloutConfig, cfg, "rollout")
    warm = typed(WarmStartConfig, cfg, "warmstart")
    eval_cfg = typed(EvalConfig, cfg, "eval")
    warm.validate()
    eval_cfg.validate()
    if threads is not None and threads < 1:
        raise ConfigError(f"torch_threads must be >= 1 or null, got {threads}")
    for key in ("model", "engine", "algo", "trainer", "logger"):
        check_target(cfg, key)
    spec = build_env(cfg)
    check_sizes(pipeline_cfg, rollout_cfg, spec)

    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)

    policy: Policy = instantiate(cfg.model)
    algorithm: Algorithm = instantiate(cfg.algo)
    trainer: Trainer = instantiate(
        cfg.trainer, policy=policy, algorithm=algorithm, temperature=rollout_cfg.temperature
    )
    logger: Logger = instantiate(cfg.logger)
    recorder = Recorder()
    metrics_file = JsonlMetrics(run_dir / "metrics.jsonl")
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    result = RunResult(run_dir=run_dir, reports=[])
    failed = True
    try:
        logger.start(config_dict, run_dir)  # type: ignore[arg-type]
        check_tasks = list(spec.tasks("train"))[: warm.check_tasks]
        checks: list[float] = []

        def accuracy() -> float:  # called from the warm start's thread
            checks.append(anyio.from_thread.run(_greedy_check, cfg, policy, trainer, spec,
                                                check_tasks, rollout_cfg))
            log.info("warm start: greedy accuracy %.3f on %d train tasks", checks[-1], len(check_tasks))
            return checks[-1]

        async def session() -> None:
            # one event loop for the whole run, so what the environment runs for it (a
            # sandbox pool, a service) lives from the first warm-start check to the last eval
            async with spec.running():
                with recorder.span("warm_start", "trainer", 0) as attrs:
                    losses = await anyio.to_thread.run_sync(lambda: warm_start(
                        trainer, policy.tokenizer, spec.tasks("train"), warm, seed=seed,
                        accuracy=accuracy, demonstrate=spec.demonstration))
                    attrs.update(steps=len(losses), accuracy=checks[-1] if checks else None)
                if losses:
                    log.info("warm start: %d steps, final loss %.3f", len(losses), losses[-1])
                result.warm_start_steps = len(losses)
                await _train(cfg, policy, trainer, spec, pipeline_cfg, rollout_cfg, eval_cfg,
                             progress, recorder, [logger, metrics_file], result)

        try:
            anyio.run(session)
        except BaseException:
            if result.reports or result.warm_start_steps:  # keep what was trained, even if
                # the run did not finish (the warm start alone may be a thousand steps)
                save_checkpoint(trainer, run_dir / "checkpoints" / "interrupted")
            raise
        save_checkpoint(trainer, run_dir / "checkpoints" / "final")
        failed = False
    finally:
        recorder.write_jsonl(run_dir / "spans.jsonl")
        write_timeline(recorder.spans, run_dir / "timeline.json", process=run_dir.name)
        result.summary = _summary(result)
        (run_dir / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        for sink in (metrics_file, logger):
            if result.summary:
                sink.log({f"summary/{k}": v for k, v in result.summary.items()
                          if isinstance(v, (int, float))}, len(result.reports))
            sink.finish(failed=failed)
    return result


async def _train(
    cfg: DictConfig,
    policy: Policy,
    trainer: Trainer,
    spec: EnvSpec,
    pipeline_cfg: PipelineConfig,
    rollout_cfg: RolloutConfig,
    eval_cfg: EvalConfig,
    progress_bar: bool,
    recorder: Recorder,
    sinks: list[Logger],
    result: RunResult,
) -> None:
    engine: InferenceEngine = instantiate(cfg.engine, policy=policy, version=trainer.version)
    eval_tasks = list(spec.tasks("eval"))[: eval_cfg.num_tasks]
    async with engine:
        if eval_tasks:
            result.eval_before = await evaluate(engine, policy.tokenizer, spec, eval_tasks, rollout_cfg, recorder)
            log.info("eval before RL: %.3f", result.eval_before)
        with StepProgress(pipeline_cfg.num_steps, enabled=progress_bar) as progress:

            trace = TraceWriter(result.run_dir, rollout_cfg.max_total_tokens)
            samples = (result.run_dir / "samples.jsonl").open("a")

            def on_step(report: StepReport) -> None:
                trace.write_step(report.step, report.version, report.groups)
                write_samples(samples, report, policy.tokenizer)
                for sink in sinks:
                    sink.log_step(report)
                progress.update(report)
                result.reports.append(report)

            pipeline = Pipeline(
                pipeline_cfg, rollout_cfg, engine, trainer, policy.tokenizer, spec,
                TaskSampler(spec.tasks("train"), seed=int(cfg.seed)), recorder, on_step,
            )
            try:
                await pipeline.run()
            finally:
                samples.close()
        if eval_tasks:
            result.eval_after = await evaluate(engine, policy.tokenizer, spec, eval_tasks, rollout_cfg, recorder)
            log.info("eval after RL: %.3f", result.eval_after)


def write_samples(file: TextIO, report: StepReport, tokenizer: Tokenizer, per_step: int = 4) -> None:
    """A few trained episodes of the step as text (the first of each group), to read what the
    policy does: ``{"step", "prompt_id", "reward", "end_reason", "text"}`` per line."""
    for group in report.groups[:per_step]:
        t = group.trajectories[0]
        file.write(json.dumps({"step": report.step, "prompt_id": t.prompt_id, "reward": t.reward,
                               "end_reason": t.end_reason,
                               "text": tokenizer.decode(list(t.token_ids))}) + "\n")
    file.flush()


async def _greedy_check(
    cfg: DictConfig,
    policy: Policy,
    trainer: Trainer,
    spec: EnvSpec,
    tasks: list[Task],
    rollout_cfg: RolloutConfig,
) -> float:
    engine: InferenceEngine = instantiate(cfg.engine, policy=policy, version=trainer.version)
    async with engine:
        return await evaluate(engine, policy.tokenizer, spec, tasks, rollout_cfg, Recorder())


def _summary(result: RunResult) -> dict[str, Any]:
    reports = result.reports
    if not reports:
        return {}
    tenth = max(1, len(reports) // 10)
    first = sum(r.reward_mean for r in reports[:tenth]) / tenth
    last = sum(r.reward_mean for r in reports[-tenth:]) / tenth
    wall = sum(r.elapsed for r in reports)
    samples = sum(r.samples for r in reports)
    return {
        "steps": len(reports),
        "warm_start_steps": result.warm_start_steps,
        "reward_first_10pct": first,
        "reward_last_10pct": last,
        "eval_before": result.eval_before,
        "eval_after": result.eval_after,
        "dropped_stale": reports[-1].dropped_total,
        "samples_per_s": samples / max(wall, 1e-9),
        "rl_seconds": wall,
    }
