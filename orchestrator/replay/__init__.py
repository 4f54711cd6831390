"""Trace replay: a PolyTrace workload played through the run loop in virtual time.

Layout (imports point down the list, and into :mod:`orchestrator.trace`, never back):

* :mod:`~orchestrator.replay.run` — :func:`replay_parts` (``experiment=replay``) and
  :func:`replay` (benches), both through :func:`orchestrator.run.loop.run_session`;
* :mod:`~orchestrator.replay.plans` — episode plans from a trace's multi-turn workload;
* :mod:`~orchestrator.replay.fit` — the server model's fit to trace steps and its fidelity
  (``python -m orchestrator.replay fit``), :class:`EngineFit`;
* :mod:`~orchestrator.replay.bound` — what no scheduler can beat on a workload: the
  replicas' work at full throughput, or the trainer, a step (:func:`workload_bound`);
* :mod:`~orchestrator.replay.engine` — :func:`replay_engine`: the simulated engine
  (:mod:`orchestrator.engines.simulated`) serving episode plans (:class:`PlanReplies`) in the
  time of the continuously-batched server model of :mod:`~orchestrator.replay.model`
  (:class:`FluidServer`); ``replay.engines`` replicas go behind the one router,
  :class:`orchestrator.engines.router.EngineRouter`, and the trainer is the simulated one,
  :class:`orchestrator.trainer.simulated.SimulatedTrainer`, priced by :class:`TrainerModel`;
* :mod:`~orchestrator.replay.tokenizer` — :class:`ReplayTokenizer`, token ids of the
  replay environment's messages (:mod:`envs.replay`).
"""

from orchestrator.config.schema import ReplayConfig
from orchestrator.replay.bound import Bound, workload_bound
from orchestrator.replay.engine import FluidServer, PlanReplies, replay_engine
from orchestrator.replay.fit import SHIPPED_FIT, EngineFit, fit_trace
from orchestrator.replay.model import ServerParams
from orchestrator.replay.plans import load_plans, plans_from_records, resample_groups
from orchestrator.replay.run import ReplayResult, TrainerModel, replay, replay_parts, run_virtual
from orchestrator.replay.tokenizer import ReplayTokenizer

__all__ = [
    "SHIPPED_FIT", "Bound", "EngineFit", "FluidServer", "PlanReplies", "ReplayConfig",
    "ReplayResult", "ReplayTokenizer", "ServerParams", "TrainerModel", "fit_trace", "load_plans",
    "plans_from_records", "replay", "replay_engine", "replay_parts", "resample_groups",
    "run_virtual", "workload_bound",
]
