"""A run's configuration, read and checked once where the run starts: :func:`run_config`.

Hydra composes ``conf/`` into a ``DictConfig``; :func:`run_config` turns it into a
:class:`RunConfig` before anything is built: the plain sections as
:mod:`~orchestrator.config.schema`'s typed records (every value checked against its field),
the top-level scalars checked against their types, and each ``_target_`` node as a plain
mapping whose keys were checked against what it names. The builders
(:mod:`orchestrator.builders`) and the commands that share them take a ``RunConfig`` and read no
raw config; a mistake is one line naming the key, before a model or an engine exists.

The ``algo`` node is checked by the algorithm's own builder
(:func:`orchestrator.algo.build.build_algorithm`), which knows its pieces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.read import check_node, scalar, section, typed
from orchestrator.config.schema import (
    CheckpointConfig,
    EvalConfig,
    PipelineConfig,
    RolloutConfig,
    WarmStartConfig,
)

log = logging.getLogger(__name__)

NODES = ("model", "engine", "trainer", "env", "launcher", "logger")  # checked _target_ nodes


@dataclass(frozen=True)
class RunConfig:
    """Everything a run's builders read, typed and checked (:func:`run_config`)."""

    seed: int
    torch_threads: int | None
    progress: bool
    progress_every: float
    pipeline: PipelineConfig
    rollout: RolloutConfig
    warmstart: WarmStartConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    model: dict[str, Any]
    engine: dict[str, Any]
    trainer: dict[str, Any]
    algo: dict[str, Any]
    env: dict[str, Any]
    launcher: dict[str, Any]
    logger: dict[str, Any]
    # the whole composed config, resolved: what the run directory's config.yaml holds (a
    # resumed run, python -m orchestrator.eval and export read it back)
    resolved: dict[str, Any]


def run_config(cfg: DictConfig) -> RunConfig:
    """``cfg`` read into a :class:`RunConfig`; raises :class:`~orchestrator.errors.ConfigError`
    in one line naming the key on the first mistake."""
    nodes: dict[str, dict[str, Any]] = {}
    for key in NODES:
        nodes[key] = section(cfg, key)
        check_node(nodes[key], key)
    eval_cfg = typed(EvalConfig, cfg, "eval")
    if eval_cfg.n > 1 and eval_cfg.temperature == 0:
        log.warning("eval.n=%d at eval.temperature=0: greedy samples of a task are alike; set "
                    "eval.temperature for pass@k and maj@n to mean anything", eval_cfg.n)
    return RunConfig(
        seed=scalar(cfg, "seed"),
        torch_threads=scalar(cfg, "torch_threads"),
        progress=scalar(cfg, "progress"),
        progress_every=scalar(cfg, "progress_every"),
        pipeline=typed(PipelineConfig, cfg, "pipeline"),
        rollout=typed(RolloutConfig, cfg, "rollout"),
        warmstart=typed(WarmStartConfig, cfg, "warmstart"),
        eval=eval_cfg,
        checkpoint=typed(CheckpointConfig, cfg, "checkpoint"),
        algo=section(cfg, "algo"),
        resolved=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        **nodes,
    )
