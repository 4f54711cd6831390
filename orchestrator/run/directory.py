"""The run directory and its one writer.

Every file of a run is written through :class:`RunDir`: ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per step, :func:`~orchestrator.loggers.base.step_metrics`), the
PolyTrace records of every trained step in ``trace/`` (compressed and rolled, see
:mod:`orchestrator.trace.writer`), ``samples.jsonl`` (a few trained episodes per step as
text, with each generated segment's engine, version and weights' fingerprint), ``eval_samples.jsonl`` (every sample of each evaluation: prompt, completion, final reply,
reward, answer and its maj@n group, the row it was read from), ``spans/`` (the run's recorder, :meth:`RunDir.open_recorder`, streams its spans there
in compressed segments, flushed with every step) and at the end ``timeline.json`` (Perfetto,
built from the spans of the last :data:`TIMELINE_STEPS` steps; ``python -m orchestrator.trace
timeline <run_dir> --steps A:B`` builds any other window) and ``summary.json``; checkpoints go
under ``checkpoints/``. The files that grow with a run are compressed as they are written
(``codec``: ``zst`` by default, ``gz``, or ``none`` for plain files),
so a day-long run's directory stays a few GB (``python -m bench.rundir``). The run's loggers (W&B) get the same metrics. Training
and replay both write through it, so their run directories have one layout and one metrics
schema. Steps are written as they are reported and the rest on :meth:`close`, which also runs
for a failed run; memory stays flat however long the run.

A resumed run opens its directory at the checkpoint's step (``resume_step``): the records of
later steps, which it will write again, are cut first (:func:`truncate_after`), and the
metrics of the steps before it are read back (:attr:`RunDir.earlier`) for a summary of the
whole run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.base import Clock
from orchestrator.loggers.base import JsonlMetrics, Logger
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trace.jsonl import CODEC, Codec
from orchestrator.trace.reader import RUN_TRACE
from orchestrator.trace.recorder import PLAIN_SPANS, SPANS_DIR, Recorder, spans_path
from orchestrator.trace.timeline import write_timeline
from orchestrator.trace.writer import TraceWriter
from orchestrator.types import Evaluation, StepReport

SAMPLES_PER_STEP = 4
EVAL_SAMPLES = "eval_samples.jsonl"
TIMELINE = "timeline.json"
TIMELINE_STEPS = 50  # the steps timeline.json shows at the end of a run (the last ones)


class RunDir:
    def __init__(self, path: Path, config: Mapping[str, Any], loggers: Sequence[Logger] = (),
                 max_total_tokens: int | None = None, codec: Codec = CODEC,
                 timeline_steps: int | None = TIMELINE_STEPS,
                 resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.resumed = resume_step is not None
        self.earlier: list[dict[str, Any]] = []  # metrics of the steps before a resumed run's
        # the fault counters last recorded (before a resume cuts the records they are in)
        self.faults_recorded: dict[str, float] = faults_recorded(self.path)
        # a fresh start where an earlier attempt recorded steps and never finished: a driver
        # killed before the run's first checkpoint, started again from the beginning
        self.restarted = resume_step is None and _attempt_left_steps(self.path)
        # steps past the checkpoint are redone; a fresh start (resume=auto finding no
        # checkpoint after a crash) cuts the records an earlier attempt left here
        truncate_after(self.path, resume_step if resume_step is not None else 0)
        if resume_step is not None:
            self.earlier = steps_before(self.path, resume_step)
        (self.path / "config.yaml").write_text(_yaml(config))
        self._metrics = JsonlMetrics(self.path / "metrics.jsonl")
        self._sinks: list[Logger] = [self._metrics, *loggers]
        for logger in loggers:
            logger.start(dict(config), self.path)
        self.codec = codec
        self.timeline_steps = timeline_steps  # None: the whole run
        self._trace = TraceWriter(self.path / RUN_TRACE, max_total_tokens, codec)
        self._samples = (self.path / "samples.jsonl").open("a")
        self._eval_samples = (self.path / EVAL_SAMPLES).open("a")
        self.recorder: Recorder | None = None
        self.steps = 0

    def open_recorder(self, clock: Clock) -> Recorder:
        """The run's recorder on ``clock``, streaming to ``spans/`` (a resumed run's after the
        spans already there, on a clock that goes on from them)."""
        append = self.resumed
        if self.codec == "none":
            self.recorder = Recorder(clock, self.path / PLAIN_SPANS, append=append)
        else:
            self.recorder = Recorder(clock, self.path / SPANS_DIR, append=append, codec=self.codec)
        return self.recorder

    def checkpoint_dir(self, name: str) -> Path:
        return self.path / "checkpoints" / name

    def write_step(self, report: StepReport, tokenizer: Tokenizer) -> None:
        self._trace.write_step(report.step, report.version, report.groups, report.timings)
        for group in report.groups[:SAMPLES_PER_STEP]:  # the first episode of a few groups
            t = group.trajectories[0]
            self._samples.write(json.dumps({
                "step": report.step, "prompt_id": t.prompt_id, "reward": t.reward,
                "end_reason": t.end_reason, "text": tokenizer.decode(list(t.token_ids)),
                "segments": [dataclasses.asdict(a) for a in t.attestations]}) + "\n")
        self._samples.flush()
        for sink in self._sinks:
            sink.log_step(report)
        if report.evaluation is not None:  # a periodic one, its figures in the step's metrics
            began = int(report.metrics.get("eval/step", report.step))
            self._write_examples("during", began, report.evaluation)
            for sink in self._sinks:
                sink.log_evaluation("during", report.step, report.evaluation)
        if self.recorder is not None:
            self.recorder.flush()  # after the step's report, which read its spans
        self.steps += 1

    def write_evaluation(self, when: str, step: int, evaluation: Evaluation) -> None:
        """The evaluation ``before`` or ``after`` RL (``step``: the steps trained before it):
        every sample to ``eval_samples.jsonl``, and to the loggers (its figures go into
        ``summary.json`` and the summary line of ``metrics.jsonl`` at the end)."""
        self._write_examples(when, step, evaluation)
        for sink in self._sinks:
            sink.log_evaluation(when, step, evaluation)

    def _write_examples(self, when: str, step: int, evaluation: Evaluation) -> None:
        for s in evaluation.samples or evaluation.examples:  # every generation it kept
            self._eval_samples.write(json.dumps({
                "when": when, "step": step, "source": s.source, "task_id": s.task_id,
                "origin": s.origin, "sample": s.sample_index, "prompt": s.prompt,
                "completion": s.completion, "reply": s.reply, "reward": s.reward,
                "answer": s.answer, "vote": s.vote, "reference": s.reference}) + "\n")
        self._eval_samples.flush()

    def close(self, summary: Mapping[str, Any], failed: bool) -> None:
        self._samples.close()
        self._eval_samples.close()
        self._trace.close()
        if self.recorder is not None:
            self.recorder.close()
            steps = None if self.timeline_steps is None else slice(-self.timeline_steps, None)
            write_timeline(spans_path(self.path), self.path / TIMELINE, process=self.path.name,
                           steps=steps)
        (self.path / "summary.json").write_text(json.dumps(dict(summary), indent=2) + "\n")
        scalars = {f"summary/{k}": v for k, v in summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for when in ("eval_before", "eval_after"):  # every figure: summary/eval_after/pass@1, …
            detail = summary.get(f"{when}_detail")
            if isinstance(detail, Mapping):
                scalars.update({f"summary/{k}": v for k, v
                                in Evaluation.from_dict(detail).metrics(when).items()})
        for sink in self._sinks:
            if scalars:
                sink.log(scalars, self.steps)
            sink.finish(failed=failed)


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    """A record a command adds to a finished run's directory (``orchestrator.commands.eval``'s
    evaluation), or anywhere it is asked to: written beside ``path`` and renamed into
    place, so a reader never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dict(record), indent=2) + "\n")
    tmp.replace(path)


def write_jsonl(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Records a command adds (``orchestrator.commands.eval``'s samples of one evaluation), one JSON
    line each, written beside ``path`` and renamed into place as :func:`write_json` does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as file:
        for record in records:
            file.write(json.dumps(dict(record)) + "\n")
    tmp.replace(path)


def truncate_after(run_dir: Path, step: int) -> None:
    """Make ``run_dir``'s records end where the checkpoint at ``step`` does, so the resumed
    run appends steps ``step, step + 1, …`` with no repeat: lines of later steps (and a
    finished run's summary line) leave ``metrics.jsonl`` and ``samples.jsonl``, and later
    steps' PolyTrace records are removed (:func:`~orchestrator.trace.writer.drop_steps_from`).
    A line cut short by a crash is dropped too."""
    from orchestrator.trace.writer import drop_steps_from

    for name, keep in (("metrics.jsonl", _metrics_line_kept), ("samples.jsonl", _sample_line_kept),
                       (EVAL_SAMPLES, _eval_sample_line_kept)):
        path = run_dir / name
        if path.is_file():
            lines = [line for line in path.read_text().splitlines() if keep(line, step)]
            path.write_text("".join(line + "\n" for line in lines))
    drop_steps_from(run_dir, step)


def _attempt_left_steps(run_dir: Path) -> bool:
    """Whether ``metrics.jsonl`` holds steps of an attempt that did not finish (no summary)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    records = [r for r in map(_parse, path.read_text().splitlines()) if r is not None]
    finished = any(k.startswith("summary/") for r in records for k in r)
    return not finished and any("step" in r for r in records)


def faults_recorded(run_dir: Path) -> dict[str, float]:
    """The largest value of each ``faults/…`` counter in ``metrics.jsonl`` (empty: none)."""
    path = run_dir / "metrics.jsonl"
    totals: dict[str, float] = {}
    if path.is_file():
        for record in map(_parse, path.read_text().splitlines()):
            for key, value in (record or {}).items():
                if key.startswith("faults/") and isinstance(value, int | float):
                    totals[key] = max(totals.get(key, 0.0), float(value))
    return totals


def steps_before(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` records of steps ``0 .. step - 1`` (a resumed run's summary
    covers them too)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [_parse(line) for line in path.read_text().splitlines()]
    return [r for r in records if r is not None and _metrics_line_kept_record(r, step)]


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _metrics_line_kept(line: str, step: int) -> bool:
    record = _parse(line)
    return record is not None and _metrics_line_kept_record(record, step)


def _metrics_line_kept_record(record: dict[str, Any], step: int) -> bool:
    return record.get("step", step) < step and not any(k.startswith("summary/") for k in record)


def _sample_line_kept(line: str, step: int) -> bool:
    record = _parse(line)
    return record is not None and record.get("step", step) < step


def _eval_sample_line_kept(line: str, step: int) -> bool:
    """The evaluation before RL is not run again by a resumed run: its samples stay."""
    record = _parse(line)
    return record is not None and (record.get("when") == "before"
                                   or record.get("step", step) < step)


def _yaml(config: Mapping[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dict(config)))
