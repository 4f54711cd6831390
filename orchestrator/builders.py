"""One run from a composed config: ``run(cfg, run_dir)``.

A training run builds the policy, environment, algorithm and trainer the config names
(:func:`training_parts`); ``experiment=replay`` builds a trace replay in virtual time instead
(:func:`orchestrator.replay.replay_parts`). Either way the parts go through the one run loop
(:func:`orchestrator.run.loop.run_session`) and the one run-directory writer
(:class:`orchestrator.run.directory.RunDir`): ``config.yaml``, ``metrics.jsonl``, the PolyTrace
files, ``samples.jsonl``, ``eval_samples.jsonl``, ``spans/``, ``timeline.json``, ``summary.json``, periodic
checkpoints ``checkpoints/step-<N>/`` to resume from (at the end of the first step a minute,
``checkpoint.every_s``, after the last one began, or every ``checkpoint.every`` steps; when a
signal stops the run; after a crash when the trainer still holds the last step's weights)
and ``checkpoints/final/``. Everything but the final checkpoint is written even when
the run fails part-way.

``run(cfg, run_dir, resume_from=<checkpoint>)`` continues a run in its own directory (see
:mod:`orchestrator.run.resume`, which also reads the command line's ``resume=``).
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from envs.base import EnvSpec, Task
from envs.errors import EnvConfigError
from orchestrator.algo.build import algorithm_values, build_algorithm
from orchestrator.algo.filters import FILTER_KEY, build_filter
from orchestrator.algo.losses import cannot_act
from orchestrator.config.read import CONF, check_node, env_from, section, target_of
from orchestrator.config.run import RunConfig, run_config
from orchestrator.config.schema import EvalConfig, PipelineConfig, RolloutConfig
from orchestrator.engines.base import InferenceEngine, sync_weights
from orchestrator.engines.placement import Placement
from orchestrator.episodes.rollout import EpisodeRunner, data_source
from orchestrator.errors import ConfigError
from orchestrator.faults import resumed_faults
from orchestrator.gateway.serve import ModelServer
from orchestrator.launch import EngineRecipe, Launcher, LocalLauncher, TrainerRecipe
from orchestrator.loggers.base import Logger
from orchestrator.models.policy import build_tokenizer, model_context
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.run.directory import RunDir
from orchestrator.run.loop import Checkpointer, RunParts, RunResult, run_session, summarise
from orchestrator.run.resume import restore
from orchestrator.run.warmstart import warm_start
from orchestrator.trace.recorder import Recorder
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)

JudgeServing = Callable[[], AbstractAsyncContextManager[None]]  # served_judge's


def run(cfg: DictConfig, run_dir: Path, resume_from: Path | None = None) -> RunResult:
    """Run the experiment ``cfg`` describes, or go on from the checkpoint ``resume_from`` of
    ``run_dir``; raises :class:`ConfigError` on bad input. A training run's config is read and
    checked once, here (:func:`~orchestrator.config.run.run_config`); the builders below take
    that typed :class:`~orchestrator.config.run.RunConfig`."""
    with ExitStack() as resources:  # the launcher's actors live as long as the run
        if OmegaConf.select(cfg, "replay") is not None:
            if resume_from is not None:
                raise ConfigError("a replay has nothing to resume: it runs in virtual time")
            from orchestrator.replay import replay_parts

            logger = section(cfg, "logger")
            check_node(logger, "logger")
            return _run(replay_parts(cfg), run_dir, logger,
                        OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        config = run_config(cfg)
        launcher: Launcher = resources.enter_context(instantiate(config.launcher))
        while True:
            parts = training_parts(config, launcher)
            try:
                return _run(parts, run_dir, config.logger, config.resolved, resume_from)
            except BaseException as error:
                # a launcher that replaced what it lost (a dead trainer actor) goes on from the
                # last checkpoint, as resume= would, without the user
                if not launcher.recover(error):
                    raise
                checkpoint = CheckpointStore(run_dir / "checkpoints").latest_valid()
                if checkpoint is None:
                    raise
                log.warning("restarting from %s", checkpoint)
                resume_from = checkpoint


def _run(parts: RunParts, run_dir: Path, logger_node: dict[str, Any], resolved: dict[str, Any],
         resume_from: Path | None = None) -> RunResult:
    """``parts`` through the run loop, written to ``run_dir`` (``resolved``: its
    ``config.yaml``) and the logger ``logger_node`` builds."""
    logger: Logger = instantiate(logger_node)
    resume = restore(parts.trainer, resume_from) if resume_from is not None else None
    if resume is not None:
        logger.resume_id = resume.logger_run_id
    out = RunDir(run_dir, resolved, [logger], parts.rollout.max_total_tokens,
                 resume_step=resume.step if resume else None)
    faults = None  # the fault counters go on from the whole run's, this restart counted
    if resume is not None:
        resume.pipeline["faults"] = resumed_faults(resume.pipeline.get("faults", {}),
                                                   out.faults_recorded)
    elif out.restarted:  # killed before its first checkpoint: from the beginning, still counted
        faults = resumed_faults({}, out.faults_recorded)
    checkpointer = None
    if parts.checkpoint is not None:
        checkpointer = Checkpointer(
            CheckpointStore(out.path / "checkpoints", parts.checkpoint.keep), parts.checkpoint,
            parts.trainer, logger_run_id=lambda: logger.run_id, resumed=resume,
            eval_every=parts.evaluation.every if parts.eval_tasks else 0)
    result = RunResult(run_dir=run_dir)
    failed = True
    try:
        try:
            anyio.run(partial(run_session, parts, result,
                              lambda report: out.write_step(report, parts.tokenizer), checkpointer,
                              out.open_recorder, resume, faults, out.write_evaluation),
                      backend=parts.anyio_backend, backend_options=dict(parts.backend_options))
        except BaseException:
            if checkpointer is not None:
                saved = checkpointer.save_last()  # keep what was trained, if consistent
                if saved is not None:
                    log.warning("the run failed; checkpoint of its last step at %s", saved)
            raise
        if checkpointer is not None:
            checkpointer.save_final(out.checkpoint_dir("final"))
        failed = False
    finally:
        result.summary = summarise(result, out.earlier, checkpointer)
        if parts.describe is not None and result.reports:
            result.summary.update(parts.describe(result))
        out.close(result.summary, failed)
    return result


def training_parts(config: RunConfig, launcher: Launcher | None = None) -> RunParts:
    """The parts of a training run: trainer and engine placed by ``launcher`` (in this process
    by default), environment, warm start, evals."""
    launcher = launcher or LocalLauncher()
    seed, threads = torch_settings(config)
    pipeline_cfg = config.pipeline
    if launcher.colocate and pipeline_cfg.inflight_update == "finish":
        # the engine sleeps through each train step with its requests in flight, and the sync
        # that would wake it waits for them to finish first
        raise ConfigError("pipeline.inflight_update=finish cannot run with launcher.colocate=true: "
                          "the engine sleeps through each train step with episodes in flight, "
                          "which could then never finish before the weight sync that wakes it; "
                          "use pipeline.inflight_update=continue or launcher.colocate=false")
    rollout_cfg = config.rollout
    warm = config.warmstart
    eval_cfg = config.eval
    checkpoint_cfg = config.checkpoint
    # algo.filter is the pipeline's (which groups a step trains), not the algorithm's
    group_filter = build_filter(config.algo.get(FILTER_KEY))
    check_node(algorithm_values(config.algo), "algo")
    algorithm = build_algorithm(config.algo)  # its pieces' checks, before anything starts
    if (idle := cannot_act(algorithm, config.trainer.get("num_minibatches", 1))):
        log.warning(idle)  # legitimate (GRPO at one update), but not what the loss is for
    model_cfg = config.model
    spec, tokenizer = environment(config)
    if len(spec.tasks("train")) == 0:
        raise ConfigError("the environment has no train tasks: a run needs them (env=dataset: "
                          "env.train=data/train.jsonl); python -m orchestrator.eval evaluates "
                          "without any")
    check_sizes(pipeline_cfg, rollout_cfg, spec)
    if group_filter is not None:
        group_filter.check(rollout_cfg.group_size)
    algorithm.check(rollout_cfg.group_size)  # e.g. a group baseline needs groups of 2 or more
    eval_tasks = eval_tasks_of(spec, eval_cfg)
    if checkpoint_cfg.keep_best is not None:  # before anything is built or trained
        if not eval_tasks:
            raise ConfigError(f"checkpoint.keep_best={checkpoint_cfg.keep_best} ranks checkpoints "
                              "by an evaluation, and eval.num_tasks=0 runs none: set it > 0")
        eval_cfg.check_ranked_figure(checkpoint_cfg.keep_best,
                                     {data_source(t, spec) for t in eval_tasks})

    attest = bool(config.engine.get("attest", False))
    trainer = launcher.trainer(TrainerRecipe(
        trainer=config.trainer, model=model_cfg, algo=config.algo,
        temperature=rollout_cfg.temperature, seed=seed, torch_threads=threads,
        weight_delta=bool(config.engine.get("delta", False)), fingerprint=attest))
    engine_recipe = engine_of(config)

    def make_engine(weights: WeightUpdate, recorder: Recorder) -> InferenceEngine:
        return launcher.engine(engine_recipe, weights, recorder)

    async def warm_up(runner: EpisodeRunner) -> int:
        check_tasks = first_tasks(spec.tasks("train"), warm.check_tasks)
        checks: list[float] = []
        recorder = runner.recorder
        unrecorded = replace(runner, recorder=Recorder(clock=recorder.clock))  # not the run's spans

        async def accuracy() -> float:  # on the run's engine, with the trainer's weights
            await sync_weights(runner.engine, await trainer.weights())
            checks.append((await evaluate(unrecorded, check_tasks)).mean)  # greedy, one each
            await runner.engine.sleep()  # colocated: the GPU back to the warm start's steps
            log.info("warm start: greedy accuracy %.3f on %d train tasks", checks[-1], len(check_tasks))
            return checks[-1]

        await runner.engine.sleep()  # colocated: the GPU is the warm start's between checks
        with recorder.span("warm_start", "trainer", trainer.version) as attrs:
            losses = await warm_start(trainer, tokenizer, spec.tasks("train"), warm, seed=seed,
                                      accuracy=accuracy, demonstrate=spec.demonstration)
            attrs.update(steps=len(losses), accuracy=checks[-1] if checks else None)
        if losses:
            log.info("warm start: %d steps, final loss %.3f", len(losses), losses[-1])
        return len(losses)

    return RunParts(
        spec=spec, tokenizer=tokenizer, trainer=trainer, make_engine=make_engine,
        sampler=TaskSampler(spec.tasks("train"), seed=seed), pipeline=pipeline_cfg,
        checkpoint=checkpoint_cfg, group_filter=group_filter, seed=seed,
        rollout=rollout_cfg, warm_start=warm_up if warm.steps > 0 else None,
        eval_tasks=eval_tasks,
        evaluation=eval_cfg,
        eval_own_engine=eval_on_own_engine(config, launcher),
        progress=config.progress,
        progress_every=config.progress_every,
        attest=attest,
        judge=served_judge(config, spec),
    )


# -- builders shared with the standalone evaluation (orchestrator.commands.eval) -------------


def torch_settings(config: RunConfig) -> tuple[int, int | None]:
    """``seed`` and ``torch_threads``, applied to this process."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    return config.seed, config.torch_threads


def environment(config: RunConfig) -> tuple[EnvSpec, Tokenizer]:
    """The environment ``env`` names and the model's tokenizer (built without the model); a
    dataset's rows whose prompts do not fit the context are left out."""
    spec = env_from(config.env)
    tokenizer = build_tokenizer(config.model)
    _leave_out_long_prompts(spec, tokenizer, config.rollout, model_context(config.model))
    return spec, tokenizer


def served_judge(config: RunConfig, spec: EnvSpec) -> JudgeServing | None:
    """The LLM judge the run serves itself (``env.judge.serve``: a ``conf/model`` entry), or
    None: an async context manager that builds that model's engine from its own weights (no
    trainer; ``engine``'s kind and options), serves it behind an OpenAI-compatible URL in
    the run's event loop and hands the URL to ``spec`` before the environment starts. The
    model's config and tokenizer are read now; an engine that cannot start is one line."""
    name = spec.judge_to_serve()
    if name is None:
        return None
    path = CONF / "model" / f"{name}.yaml"
    if not path.is_file():
        choices = ", ".join(sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
        raise ConfigError(f"env.judge.serve={name} names no model in conf/model/; choose from "
                          f"{choices}, or set env.judge.url to a server")

    def cannot_start(e: Exception) -> ConfigError:
        return ConfigError(f"env.judge.serve={name}: the judge's engine could not start "
                           f"({type(e).__name__}: {e}); set env.judge.url to a server instead, "
                           f"or fix conf/model/{name}.yaml")

    # the model's ${seed} and the like resolve against the run's settings
    judged = OmegaConf.create({**config.resolved, "model": OmegaConf.load(path)})
    try:
        model_cfg = section(judged, "model")
        tokenizer = build_tokenizer(model_cfg)
    except Exception as e:  # one line naming the key, the cause chained
        raise cannot_start(e) from e
    recipe = EngineRecipe(engine=config.engine, model=model_cfg,
                          placement=Placement(trainer_here=False))

    @asynccontextmanager
    async def serving() -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            try:
                engine = await stack.enter_async_context(recipe.build(None))  # type: ignore[arg-type]
                server = await stack.enter_async_context(ModelServer(engine, tokenizer))
            except Exception as e:  # one line naming the key, the cause chained
                raise cannot_start(e) from e
            log.info("env.judge.serve=%s: the judge is served at %s", name, server.base_url)
            spec.use_judge_url(server.base_url)
            yield

    return serving


def eval_on_own_engine(config: RunConfig, launcher: Launcher) -> bool:
    """``eval.engine`` resolved: ``auto`` gives evaluations during RL an engine of their own
    where one is cheap, the in-process torch engine on the CPU (a model copy in memory); on a
    GPU a second copy of the model and its KV cache would take GPU memory, and a vLLM engine
    or remote engines another GPU's worth, so they share."""
    if config.eval.engine != "auto":
        return config.eval.engine == "own"
    device = str(config.model.get("device", "auto"))
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    in_process = isinstance(launcher, LocalLauncher) and not launcher.colocate
    return (in_process and not on_gpu
            and getattr(target_of(config.engine), "cheap_copy_on_cpu", False))


def engine_of(config: RunConfig) -> EngineRecipe:
    """The recipe of the engine ``engine`` names, for the model ``model`` describes."""
    return EngineRecipe(engine=config.engine, model=config.model)


def eval_tasks_of(spec: EnvSpec, config: EvalConfig) -> list[Task]:
    """The evaluation's tasks: ``eval.num_tasks`` of each data source of the eval split, drawn
    at random with ``eval.seed`` (every task of a source that has fewer), in the split's order.
    Every task is built once to know its source."""
    tasks = spec.tasks("eval")
    if config.num_tasks == 0:
        return []
    order = list(range(len(tasks)))
    random.Random(config.seed).shuffle(order)
    taken: dict[str, list[int]] = defaultdict(list)
    for index in order:
        chosen = taken[data_source(tasks[index], spec)]
        if len(chosen) < config.num_tasks:
            chosen.append(index)
    return [tasks[i] for i in sorted(i for chosen in taken.values() for i in chosen)]


def first_tasks(tasks: Sequence[Task], n: int) -> list[Task]:
    """The first ``n`` tasks, without building the rest (a dataset's are built on demand)."""
    return [tasks[i] for i in range(min(n, len(tasks)))]


def prompt_budget(rollout: RolloutConfig, context: int | None) -> tuple[int, int] | None:
    """The context a dataset row's prompt must fit in (``rollout.max_total_tokens``, else the
    model's ``context``) and the most tokens the prompt may have (that less
    ``rollout.max_tokens``, left for the answer); None when the context is unknown. The one
    rule of :func:`_leave_out_long_prompts` and ``python -m orchestrator.data check``."""
    limit = rollout.max_total_tokens or context
    return None if limit is None else (limit, limit - rollout.max_tokens)


def _leave_out_long_prompts(spec: EnvSpec, tokenizer: Tokenizer, rollout: RolloutConfig,
                            context: int | None) -> None:
    """The tasks (a file's rows) whose prompt does not fit the model's context with
    ``rollout.max_tokens`` left for the answer are left out now (:meth:`EnvSpec.keep_prompts`),
    counted in one line, never a failure mid-run."""
    limits = prompt_budget(rollout, context)
    if limits is None:
        log.info("the model's context is unknown (model.max_position_embeddings, "
                 "rollout.max_total_tokens): prompts are not checked for length")
        return
    limit, budget = limits
    try:
        left_out = spec.keep_prompts(
            lambda messages: len(tokenizer.chat_prompt(messages)) <= budget)
    except EnvConfigError as e:
        raise ConfigError(str(e)) from e
    if left_out and any(left_out.values()):
        log.warning("env=%s: left out %d train and %d eval tasks whose prompt is over %d "
                    "tokens (context %d less rollout.max_tokens=%d)", spec.name,
                    left_out.get("train", 0), left_out.get("eval", 0), budget, limit,
                    rollout.max_tokens)


def check_sizes(pipeline: PipelineConfig, rollout: RolloutConfig, spec: EnvSpec) -> None:
    pipeline.check_group_size(rollout.group_size)
    prompts = pipeline.batch_size // rollout.group_size
    train = len(spec.tasks("train"))
    if prompts > train:
        raise ConfigError(
            f"pipeline.batch_size={pipeline.batch_size} needs {prompts} prompts per step "
            f"(group size {rollout.group_size}) but the environment has only {train} train tasks"
        )
