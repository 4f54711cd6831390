"""The run loop every run goes through, training and replay alike.

A builder (:func:`orchestrator.builders.training_parts`, :func:`orchestrator.replay.replay_parts`)
turns a config into :class:`RunParts`; :func:`run_session` runs them in one event loop:

1. enter the environment's run-long resources (a sandbox pool, a search service);
2. build the engine once, from the trainer's current weights;
3. the warm start, if the parts have one (it checks greedy accuracy on that same engine);
4. an evaluation (``eval.n`` samples per task; greedy by default), the RL pipeline with its
   progress bar, a second evaluation.

Every trained step goes to ``on_step`` (the run directory's writer) as it is reported, and
periodically to a checkpoint (:class:`Checkpointer`: the trainer's own snapshot, the
pipeline's own state), and each evaluation ranks the checkpoint of the weights it began with
when ``checkpoint.keep_best`` is set (:mod:`orchestrator.run.best`). A resumed run (``resume``,
:func:`orchestrator.run.resume.restore`) hands the pipeline its state back, skips the warm start and
the first evaluation, which were done, and goes on from the checkpoint's step. SIGTERM or SIGINT
ends the run after the step in progress, with a checkpoint of it, in
:class:`~orchestrator.errors.RunAborted`'s one line.
"""

from __future__ import annotations

import logging
import resource
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup

from envs.base import Clock, EnvSpec, Task
from orchestrator.algo.filters import GroupFilter
from orchestrator.config.schema import CheckpointConfig, EvalConfig, PipelineConfig, RolloutConfig
from orchestrator.engines.base import InferenceEngine, sync_weights
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError, RunAborted
from orchestrator.loggers.progress import StepProgress
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.pipeline.pipeline import PeriodicEval, Pipeline
from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.run.best import KeepBest
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.run.resume import RunState, capture_rng, link_trainer_files
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.base import Snapshot, Trainer
from orchestrator.types import Evaluation, StepReport
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)

# (the run's episode runner) -> supervised steps taken; runs before RL on the run's one engine
WarmStart = Callable[[EpisodeRunner], Awaitable[int]]
# (when: "before" or "after" RL, the steps trained before it began, the evaluation)
OnEval = Callable[[str, int, Evaluation], None]


class Checkpointer:
    """The run's periodic checkpoints, written off the trainer's path.

    :meth:`capture` notes the run's state at the end of each step (cheap: the pipeline's
    :meth:`~Pipeline.state_dict`, the RNG states). When a checkpoint is due (:meth:`due`: ``every_s`` wall seconds since the
    last one began, or ``every`` steps), :meth:`checkpoint` takes a snapshot of the trainer
    (its tensors copied; the only part the trainer waits for) and writes it with that state in
    a worker thread while training goes on; the next snapshot waits for a write still going,
    so at most one copy is held. A slow step (longer than ``every_s``) gets a checkpoint after
    it. Each write is a span (``checkpoint_snapshot`` on the trainer's path,
    ``checkpoint_write`` in the background) and is logged at DEBUG only: the progress line
    says how long ago the last one was written.

    After a crash, :meth:`save_last` writes the last captured state if the trainer still holds
    the weights it describes (a step that was cut short leaves them changed: then the previous
    periodic checkpoint is the one to resume from).

    With ``checkpoint.keep_best`` (:mod:`orchestrator.run.best`) a checkpoint is also due at each
    step a periodic evaluation (every ``eval_every`` steps) begins at, and :meth:`scored` ranks
    a checkpoint by its evaluation.
    """

    def __init__(self, store: CheckpointStore, config: CheckpointConfig, trainer: Trainer,
                 logger_run_id: Callable[[], str | None] = lambda: None,
                 resumed: RunState | None = None,
                 clock: Callable[[], float] = time.monotonic, eval_every: int = 0) -> None:
        self.store = store
        self.config = config
        self.eval_every = eval_every
        self.keep_best = None if config.keep_best is None else KeepBest(
            config.keep_best, store, resumed.best if resumed is not None else None,
            resumed.step if resumed is not None else None)
        self.trainer = trainer  # its snapshot() copies its state (blocking: call in a thread)
        self.logger_run_id = logger_run_id
        last_saved = resumed.step if resumed is not None else -1
        self.last_saved = last_saved  # the step (``RunState.step``) of the newest one written
        self.last_saved_version = resumed.version if resumed is not None else None  # its trainer's
        self.last_saved_at: float | None = None  # when (``clock``) it was written
        self.on_written: Callable[[int], None] = lambda step: None
        self.recorder = Recorder()
        self._clock = clock
        self._last_begun = clock()  # the run's start counts as a checkpoint for every_s
        self._begun_step = last_saved
        self._state: RunState | None = None
        self._rng: dict[str, Any] = {}
        self._written: anyio.Event | None = None  # set when the write in progress ends
        self._tg: TaskGroup | None = None
        self._count = 0
        # totals of the run's earlier processes (a resumed run)
        self.carried: dict[str, float] = {}
        if resumed is not None:
            self.carried = {**resumed.extra, "resumes": resumed.extra.get("resumes", 0) + 1}

    def totals(self) -> dict[str, float]:
        """The whole run's checkpoints: how many, the seconds the trainer waited for their
        snapshots (``checkpoint_pause_s``) and the seconds spent writing them in the
        background (``checkpoint_write_s``), and how many times the run was resumed."""
        now = {"checkpoints": self._count,
               "checkpoint_pause_s": self.recorder.seconds("checkpoint_snapshot"),
               "checkpoint_write_s": self.recorder.seconds("checkpoint_write")}
        totals = {k: self.carried.get(k, 0) + v for k, v in now.items()}
        totals["resumes"] = self.carried.get("resumes", 0)
        return totals

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[Self]:
        """Background writes run in here; leaving waits for the last one."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield self
            finally:
                self._tg = None

    def capture(self, pipeline: Pipeline, result: RunResult) -> None:
        """The run's state now, at the end of a step: the pipeline's own, the trainer's
        version, what ran before RL."""
        self._state = RunState(
            pipeline=pipeline.state_dict(), version=self.trainer.version,
            warm_start_steps=result.warm_start_steps, eval_before=result.eval_before,
            logger_run_id=self.logger_run_id(),
            best=self.keep_best.best if self.keep_best is not None else None)
        self._rng = capture_rng()

    def due(self) -> bool:
        state, cfg = self._state, self.config
        if state is None or state.step == self._begun_step:
            return False
        return ((cfg.every > 0 and state.step % cfg.every == 0)
                or (cfg.every_s > 0 and self._clock() - self._last_begun >= cfg.every_s)
                or self._evaluated_at(state.step))

    def _evaluated_at(self, step: int) -> bool:
        """Whether a periodic evaluation begins at ``step`` and keep_best will rank it."""
        return self.keep_best is not None and self.eval_every > 0 and step % self.eval_every == 0

    async def scored(self, step: int, evaluation: Evaluation) -> None:
        """``evaluation`` scored the weights of the checkpoint of ``step`` (keep_best ranks it;
        the one it replaces as the best is removed unless among the latest)."""
        if self.keep_best is None:
            return
        await self._wait_written()  # its write began before the evaluation ended
        self.keep_best.offer(step, evaluation)
        await anyio.to_thread.run_sync(self.store.prune)  # a replaced best, those let go

    async def checkpoint(self) -> None:
        """Snapshot the trainer now and write the checkpoint in the background."""
        state, rng = self._state, self._rng
        if state is None or state.step == self._begun_step:
            return
        await self._wait_written()
        self._begun_step, self._last_begun = state.step, self._clock()
        if self._evaluated_at(state.step):
            assert self.keep_best is not None
            self.keep_best.expect(state.step)
        with self.recorder.span("checkpoint_snapshot", "trainer", state.version, step=state.step):
            snapshot = await anyio.to_thread.run_sync(self.trainer.snapshot)
        self._written = written = anyio.Event()
        if self._tg is None:  # not inside writing(): write it here
            await self._write_in_thread(state, rng, snapshot, written)
        else:
            self._tg.start_soon(self._write_in_thread, state, rng, snapshot, written)

    async def save(self) -> Path | None:
        """The last captured state, written now (once); its path, or None if no step has
        finished. Returns when it is on disk."""
        await self.checkpoint()
        await self._wait_written()
        return self.store.path(self.last_saved) if self.last_saved >= 0 else None

    def save_last(self) -> Path | None:
        """After a crash (outside the event loop): the last captured state, when the trainer is
        still at its version."""
        state = self._state
        if state is None:
            return None
        if state.step == self.last_saved:
            return self.store.path(state.step)
        if self.trainer.version != state.version:
            return None
        try:
            snapshot = self.trainer.snapshot()
        except RunAborted as error:  # the trainer itself is gone
            log.warning("no checkpoint of the last step: %s", error)
            return None
        return self._write(state, self._rng, snapshot)

    def save_final(self, directory: Path) -> Path:
        """The trainer's files at the run's end in ``directory`` (``checkpoints/final``): hard
        links to the newest checkpoint's when it holds the trainer's version (the run's end
        writes one), so the end takes no second snapshot and no second copy on disk; else
        the trainer's snapshot, written."""
        if self.last_saved >= 0 and self.last_saved_version == self.trainer.version:
            return link_trainer_files(self.store.path(self.last_saved), directory)
        self.trainer.save(directory)
        return directory

    async def _wait_written(self) -> None:
        if self._written is not None:
            await self._written.wait()

    async def _write_in_thread(self, state: RunState, rng: dict[str, Any], snapshot: Snapshot,
                               written: anyio.Event) -> None:
        try:
            with self.recorder.span("checkpoint_write", "checkpointer", state.version,
                                    step=state.step):
                await anyio.to_thread.run_sync(self._write, state, rng, snapshot)
        finally:
            written.set()

    def _write(self, state: RunState, rng: dict[str, Any], snapshot: Snapshot) -> Path:
        totals = self.totals()  # as of this snapshot (its own write still going)
        counted = replace(state, extra={**totals, "checkpoints": totals["checkpoints"] + 1})

        def write(directory: Path) -> None:
            snapshot.write(directory)
            counted.write(directory, rng)

        path = self.store.save(state.step, write)
        self.last_saved, self.last_saved_at = state.step, self._clock()
        self.last_saved_version = state.version
        self._count += 1
        log.debug("checkpoint: step %d at %s", state.step, path)
        self.on_written(state.step)
        return path


@dataclass
class RunParts:
    """What one run is made of, whoever built it."""

    spec: EnvSpec
    tokenizer: Tokenizer
    trainer: Trainer
    # (starting weights, the run's recorder) -> the engine; called once, in the event loop
    make_engine: Callable[[WeightUpdate, Recorder], InferenceEngine]
    sampler: TaskSampler
    pipeline: PipelineConfig
    rollout: RolloutConfig
    clock: Clock = time.perf_counter  # the recorder's, handed to the environment
    warm_start: WarmStart | None = None
    eval_tasks: Sequence[Task] = ()
    # samples per task, temperature, pass@k's k; eval.every: steps between evaluations during
    # RL (0: before and after only)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    progress: bool = False
    progress_every: float = 10.0  # seconds between progress lines when stdout is not a TTY
    anyio_backend: str = "asyncio"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    # (result) -> extra summary entries: replay adds its virtual-time figures
    describe: Callable[[RunResult], dict[str, Any]] | None = None
    checkpoint: CheckpointConfig | None = None  # periodic checkpoints (None: none, no final)
    keep_batches: bool = False  # keep each report's trained groups and timings in RunResult.reports
    # evaluations during RL on an engine of their own (eval.engine, resolved): one policy version
    eval_own_engine: bool = False
    group_filter: GroupFilter | None = None  # algo.filter: groups left out of training
    seed: int = 0  # the run's: each sample's sampling seed derives from it (Pipeline)
    # engine.attest: the engine must report its weights' fingerprint (refused at start if it
    # cannot) and each batch is checked against the published ones (orchestrator/weights/attest.py)
    attest: bool = False
    # env.judge.serve: the judge model the run serves itself (orchestrator.builders.served_judge),
    # entered before the environment, whose judge calls its URL
    judge: Callable[[], AbstractAsyncContextManager[None]] | None = None


@dataclass
class RunResult:
    run_dir: Path | None
    reports: list[StepReport] = field(default_factory=list)
    warm_start_steps: int = 0
    eval_before: Evaluation | None = None
    eval_after: Evaluation | None = None
    recorder: Recorder | None = None
    wall: float = 0.0  # seconds on the run's clock, engine start to the last step
    summary: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None  # the signal that ended the run early

    @property
    def final_reward(self) -> float | None:
        """The mean reward of the run's last tenth of steps (a sweep's objective)."""
        return float(self.summary["reward_last_10pct"]) if self.summary else None

    def line(self) -> str:
        """The run's result in one line, the last the command line prints."""
        s = self.summary
        if not s:
            return f"run_dir={self.run_dir} steps=0"
        return (f"run_dir={self.run_dir} steps={s['steps']} "
                f"reward_first_10pct={s['reward_first_10pct']:.3f} "
                f"reward_last_10pct={s['reward_last_10pct']:.3f} "
                f"eval_before={s['eval_before']} eval_after={s['eval_after']} "
                f"dropped_stale={s['dropped_stale']} samples_per_s={s['samples_per_s']:.1f}")


async def run_session(parts: RunParts, result: RunResult,
                      on_step: Callable[[StepReport], None] | None = None,
                      checkpointer: Checkpointer | None = None,
                      make_recorder: Callable[[Clock], Recorder] = Recorder,
                      resume: RunState | None = None,
                      faults: Mapping[str, float] | None = None,
                      on_eval: OnEval | None = None) -> None:
    """Run ``parts``, filling ``result`` as it goes (so a failed run still reports); the
    recorder is ``make_recorder(parts.clock)`` (a run directory's streams to its spans file).
    ``resume``: the state of the checkpoint a resumed run goes on from; ``faults``: the fault
    counters a run started again from the beginning goes on from; ``on_eval``: the evaluations
    before and after RL as they finish (those during RL travel in their step's report)."""
    recorder = make_recorder(parts.clock)
    result.recorder = recorder
    async with (parts.judge() if parts.judge is not None else nullcontext()), \
            parts.spec.running(), _checkpoints(checkpointer, recorder):
        update = await parts.trainer.weights()
        engine = parts.make_engine(update, recorder)
        update.release()
        started = recorder.now()
        async with engine, AsyncExitStack() as stack:
            if parts.attest and not engine.attests:
                raise ConfigError(f"the engine ({type(engine).__name__}) cannot fingerprint the "
                                  f"weights it holds, which engine.attest=true needs; set "
                                  f"engine.attest=false to run it unattested")
            runner = EpisodeRunner(engine, parts.tokenizer, parts.spec, parts.rollout, recorder)
            evaluation = partial(evaluate, runner, parts.eval_tasks, parts.evaluation)
            periodic = await stack.enter_async_context(_periodic(parts, runner, recorder))
            pipeline = Pipeline(parts.pipeline, runner, parts.trainer, parts.sampler,
                                evaluation=periodic, group_filter=parts.group_filter,
                                seed=parts.seed,
                                attest=parts.attest)
            if resume is not None:
                pipeline.load_state_dict(resume.pipeline)
                result.warm_start_steps, result.eval_before = resume.warm_start_steps, resume.eval_before
            else:
                if faults:  # started again from the beginning: the counts go on
                    pipeline.carry_faults(faults)
                if parts.warm_start is not None:
                    result.warm_start_steps = await parts.warm_start(runner)
                    await sync_weights(engine, await parts.trainer.weights())
                if parts.eval_tasks:
                    result.eval_before = await evaluation()
                    log.info("eval before RL: %.3f  %s", result.eval_before.mean,
                             result.eval_before.describe())
                    if on_eval is not None:
                        on_eval("before", 0, result.eval_before)
                if checkpointer is not None:  # a long warm start is work worth keeping too
                    ranked = checkpointer.keep_best is not None and result.eval_before is not None
                    await _checkpoint(checkpointer, pipeline, result, force=ranked)
                    if result.eval_before is not None:
                        await checkpointer.scored(0, result.eval_before)

            async def step_done(report: StepReport) -> None:
                # The batch, and a periodic evaluation's samples, go to on_step (the run
                # directory) and are dropped here, unless the parts need the batch afterwards
                # (a replay's fidelity figures): memory stays bounded.
                kept = report if parts.keep_batches else replace(report, groups=(), timings=())
                if kept.evaluation is not None and kept.evaluation.samples:
                    kept = replace(kept, evaluation=replace(kept.evaluation, samples=()))
                result.reports.append(kept)
                if on_step is not None:
                    on_step(report)
                progress.update(report)
                if checkpointer is not None:
                    await _checkpoint(checkpointer, pipeline, result)
                    if report.evaluation is not None:  # it began with the weights of eval/step
                        await checkpointer.scored(int(report.metrics["eval/step"]),
                                                  report.evaluation)

            start = pipeline.step
            pipeline.on_step = step_done
            with StepProgress(parts.pipeline.num_steps, enabled=parts.progress,
                              completed=start, interval=parts.progress_every) as progress:
                if checkpointer is not None:
                    checkpointer.on_written = progress.checkpointed
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, pipeline, result, tg.cancel_scope)
                    await pipeline.run()
                    tg.cancel_scope.cancel()
            result.wall = recorder.now() - started
            if pipeline.stopped:
                saved = await checkpointer.save() if checkpointer is not None else None
                where = (f"resume from {saved} with: python -m orchestrator resume={saved.parent.parent}"
                         if saved is not None else "no step had finished: nothing to resume")
                raise RunAborted(f"stopped by {result.stopped_by} after "
                                 f"{start + len(result.reports)} steps; {where}")
            if checkpointer is not None:
                # the last step's state: a finished run resumed with more steps goes on from
                # its end, not its last periodic checkpoint (and keep_best ranks these weights)
                await checkpointer.save()
            if parts.eval_tasks:
                result.eval_after = await evaluation()
                log.info("eval after RL: %.3f  %s", result.eval_after.mean,
                         result.eval_after.describe())
                if on_eval is not None:
                    on_eval("after", pipeline.step, result.eval_after)
                if checkpointer is not None:
                    await checkpointer.scored(pipeline.step, result.eval_after)


@asynccontextmanager
async def _periodic(parts: RunParts, runner: EpisodeRunner,
                    recorder: Recorder) -> AsyncIterator[PeriodicEval | None]:
    """The evaluation during RL (``eval.every``), or None. With ``parts.eval_own_engine`` it
    runs on an engine of its own, built here (entered in the run's task, which exits it) and
    loaded with the weights of each step it evaluates, so an evaluation sees one policy
    version; the engine lives until the run ends."""
    every = parts.evaluation.every
    if not every or not parts.eval_tasks:
        yield None
        return

    if not parts.eval_own_engine:
        async def shared(weights: WeightUpdate | None) -> Evaluation:
            return await evaluate(runner, parts.eval_tasks, parts.evaluation)

        yield PeriodicEval(every, shared)
        return

    update = await parts.trainer.weights()
    own = parts.make_engine(update, recorder)
    update.release()
    async with own:
        async def frozen(weights: WeightUpdate | None) -> Evaluation:
            assert weights is not None
            await sync_weights(own, weights)
            return await evaluate(replace(runner, engine=own), parts.eval_tasks,
                                  parts.evaluation)

        yield PeriodicEval(every, frozen, frozen=True)


async def _checkpoint(checkpointer: Checkpointer, pipeline: Pipeline, result: RunResult,
                      force: bool = False) -> None:
    checkpointer.capture(pipeline, result)
    if force or checkpointer.due():
        await checkpointer.checkpoint()


@asynccontextmanager
async def _checkpoints(checkpointer: Checkpointer | None, recorder: Recorder) -> AsyncIterator[None]:
    if checkpointer is None:
        yield
        return
    checkpointer.recorder = recorder
    async with checkpointer.writing():
        yield


async def _stop_on_signal(pipeline: Pipeline, result: RunResult, scope: anyio.CancelScope) -> None:
    """The first SIGTERM/SIGINT ends the run after the step in progress; a second at once."""
    try:
        signals = anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
    except (NotImplementedError, ValueError):  # not the main thread: no signal handlers here
        return
    with signals as received:
        async for signum in received:
            if result.stopped_by is not None:
                scope.cancel()
                return
            result.stopped_by = signal.Signals(signum).name
            log.warning("%s: stopping after the step in progress (again to stop at once)",
                        result.stopped_by)
            pipeline.request_stop()


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (the driver's under ``launcher=ray``):
    its ``ru_maxrss``, which counts kilobytes on Linux and bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def summarise(result: RunResult, earlier: Sequence[Mapping[str, Any]] = (),
              checkpointer: Checkpointer | None = None) -> dict[str, Any]:
    """The run's figures. A resumed run's cover the whole run: ``earlier`` are the
    ``metrics.jsonl`` records of the steps before this process's first (see
    :func:`orchestrator.run.resume.steps_before`)."""
    steps = [(m["reward/mean"], m["time/step"], m["throughput/samples_per_s"] * m["time/step"])
             for m in earlier]
    steps += [(r.reward_mean, r.elapsed, r.samples) for r in result.reports]
    if not steps:
        return {}
    tenth = max(1, len(steps) // 10)
    first = sum(r for r, _, _ in steps[:tenth]) / tenth
    last = sum(r for r, _, _ in steps[-tenth:]) / tenth
    wall = sum(e for _, e, _ in steps)
    samples = sum(n for _, _, n in steps)
    dropped = (result.reports[-1].dropped_total if result.reports
               else int(earlier[-1]["staleness/dropped_total"]))
    before, after = result.eval_before, result.eval_after
    summary = {
        "steps": len(steps),
        "warm_start_steps": result.warm_start_steps,
        "reward_first_10pct": first,
        "reward_last_10pct": last,
        # the headline (mean@n; greedy accuracy by default), and every figure beside it
        "eval_before": None if before is None else before.mean,
        "eval_after": None if after is None else after.mean,
        "eval_before_detail": None if before is None else before.to_dict(),
        "eval_after_detail": None if after is None else after.to_dict(),
        "dropped_stale": dropped,
        "samples_per_s": samples / max(wall, 1e-9),
        "rl_seconds": wall,
        "peak_rss_mb": peak_rss_mb(),  # this process's, not the earlier ones' of a resumed run
    }
    if checkpointer is not None:
        summary.update(checkpointer.totals())
        if checkpointer.keep_best is not None:  # the step, path, metric and value
            summary["best_checkpoint"] = checkpointer.keep_best.summary()
    return summary
