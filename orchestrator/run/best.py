"""``checkpoint.keep_best=<metric>``: the checkpoint whose evaluation scored highest by one
figure, kept besides the latest ``checkpoint.keep``.

Which weights an evaluation scores. Each evaluation is paired with the checkpoint of the
weights it began with, which the run loop makes sure is written:

* before RL: the checkpoint at step 0 (after the warm start);
* during RL (``eval.every``): the one began after step B is paired with ``step-B``, written
  at the end of that step (a checkpoint is due there whatever ``checkpoint.every`` says) and
  held (:meth:`CheckpointStore.hold`) until its evaluation reports, however many newer ones
  are written meanwhile. It runs alongside rollout, so weights of a step or two later may
  have answered some of its episodes (the limit of :mod:`orchestrator.pipeline.evaluation`);
* after RL: the checkpoint of the last step, written before it.

A checkpoint becomes the best when its figure is higher than the best's so far (a tie keeps
the earlier). The best is named in ``checkpoints/best.json`` and in ``summary.json``, and
travels in each checkpoint's ``run_state.json``: a resumed run knows it (and a better one
``best.json`` names, scored after that checkpoint was written, unless its step is one the run
trains again). ``orchestrator.commands.eval`` and ``orchestrator.commands.export`` take
``--step best``.

The figure names are those of :meth:`~orchestrator.types.Evaluation.metrics` where higher is
better: :meth:`~orchestrator.pipeline.evaluation.EvalConfig.ranked_figures` lists them, and a run
asking for another stops at start-up in one line. A figure an evaluation does not give (``maj@n``
where no sample gave an answer) leaves that checkpoint unranked, with a warning.
"""

from __future__ import annotations

import logging

from orchestrator.run.checkpoint import Best, CheckpointStore
from orchestrator.types import Evaluation

log = logging.getLogger(__name__)


class KeepBest:
    def __init__(self, metric: str, store: CheckpointStore, best: Best | None = None,
                 resumed_at: int | None = None) -> None:
        """``best``, ``resumed_at``: a resumed run's checkpoint's best and step. ``best.json``
        may name a better one scored after that checkpoint was written: it counts if its
        step is not trained again (<= ``resumed_at``). Another metric's best does not."""
        self.metric = metric
        self.store = store
        candidates = [best]
        if resumed_at is not None:
            on_disk = store.best()
            candidates.append(on_disk if on_disk is not None and on_disk.step <= resumed_at
                              else None)
        ranked = [b for b in candidates if b is not None and b.metric == metric]
        self.best = max(ranked, key=lambda b: (b.value, -b.step), default=None)
        store.set_best(self.best)
        self._pending: set[int] = set()

    def expect(self, step: int) -> None:
        """The checkpoint of ``step`` is about to be written and an evaluation will score it:
        keep it until then."""
        self._pending.add(step)
        self.store.hold(self._pending)

    def offer(self, step: int, evaluation: Evaluation) -> bool:
        """``evaluation`` scored the checkpoint of ``step`` (on disk by now): whether it became
        the best. Checkpoints held for evaluations up to ``step`` are let go (one skipped
        while another ran never reports); the next prune removes them and a replaced best."""
        self._pending = {s for s in self._pending if s > step}
        self.store.hold(self._pending)
        value = evaluation.figure(self.metric)
        if value is None:
            log.warning("checkpoint.keep_best=%s: the evaluation of step %d has no such figure; "
                        "its checkpoint is not ranked", self.metric, step)
            return False
        if step not in self.store.steps():
            log.warning("checkpoint.keep_best: no checkpoint of step %d to rank", step)
            return False
        if self.best is not None and value <= self.best.value:
            return False
        self.best = Best(step=step, metric=self.metric, value=value)
        self.store.set_best(self.best)
        log.info("best checkpoint: step %d, %s %.4f", step, self.metric, value)
        return True

    def summary(self) -> dict[str, object] | None:
        """``summary.json``'s ``best_checkpoint``."""
        if self.best is None:
            return None
        return {"path": f"checkpoints/step-{self.best.step}", "step": self.best.step,
                "metric": self.metric, "value": self.best.value}
