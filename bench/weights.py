"""Delta weight sync: what a step's update moves as a delta against the full update, what it
costs in time, and whether every reconstruction is the published weights bit for bit.

Each figure comes from a real run under ``launcher=ray`` (the trainer and one engine in two Ray
actors; the update travels through the object store), started as a user would start it
(``python -m orchestrator``), read back from its own files:

* ``delta_payload_ratio``: per step, the bytes the engine pulled as a delta over the bytes of
  the full update (``weights/delta_bytes`` / ``weights/full_bytes``), the median over the steps
  whose sync came as a delta, from step 1 (step 0 reports the sync before RL: a warm start's,
  if any); also the smallest and largest;
* every reconstruction checked: each delta the engine applied was kept only because its
  fingerprint afterwards equalled the published one (``weights/delta_loads`` must be one per
  step after the first, ``weights/delta_fallbacks`` and ``faults/attestation`` zero); a run
  where either is not so is reported as such, and the headline refused;
* the sync's time, median over steps, the same experiment with ``engine.delta=false``
  beside it: the trainer actor's put (and, with deltas, the encoding: ``weights_delta``), the
  engine actor's load (``weight_sync``: pulling, applying, fingerprinting) and the driver's
  whole ``weight_sync`` (pause, the engines' loads, resume).

Workloads: SmolLM2-135M in bf16 (``experiment=rg_smol model.dtype=bfloat16``), 20 RL steps at
lr 1e-6 and at the experiment's own lr (5e-6), and the toy model of the default experiment
(float32) at lr 1e-6 and at its own lr. Evaluations are off. Last line:
``delta_payload_ratio=<SmolLM2 bf16 at lr 1e-6>`` (issue 47's target: <= 0.15).

``--quick``: 6 steps each. ``--smoke`` (seconds past Ray's start, what the tests run): the toy
model alone (:data:`bench.cli.TOY_MODEL`), 4 steps at lr 1e-6 with and without deltas, its
ratio as the headline. If SmolLM2 cannot be loaded (its wheel missing) the bench says so in one
line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.peers_trl import REPO, base_args, experiment
from orchestrator.errors import ConfigError
from orchestrator.trace.recorder import read_spans, spans_path

SMOL = ("rg_smol", ("model.dtype=bfloat16",))
TOY = ("arithmetic", ())
LOW_LR = 1e-6
# one engine and the trainer, one CPU each; no evaluation; each engine's spans flushed often
RAY = ("launcher=ray", "launcher.num_engines=1", "launcher.span_flush_s=1", "eval.num_tasks=0",
       "pipeline.max_staleness=1")


@dataclass(frozen=True)
class Figures:
    """One run's figures: per-step ratios (steps synced by a delta), the count of syncs, and
    the medians of the sync's parts, in seconds."""

    ratios: list[float]
    steps: int
    delta_loads: int
    fallbacks: int
    attestation: int
    full_bytes: float
    put_s: float
    encode_s: float
    load_s: float
    sync_s: float  # the driver's weight_sync: pause, every engine's load, resume

    @property
    def checked(self) -> bool:
        """Every sync after the first step a delta, every one attested, none fell back."""
        return (self.delta_loads >= self.steps - 1 and self.fallbacks == 0
                and self.attestation == 0)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(name: str, overrides: Sequence[str], lr: float, steps: int, delta: bool,
        folder: Path, address: str | None = None) -> Figures:
    """``python -m orchestrator`` with the experiment ``name`` under Ray (a local one it
    starts, or the running cluster at ``address``); its figures."""
    run_dir = folder / f"{name}-{lr:g}-{'delta' if delta else 'full'}"
    on_cluster = [f"launcher.address='{address}'"] if address else []
    args = [*base_args(name), *overrides, *RAY, *on_cluster, f"engine.delta={str(delta).lower()}",
            f"trainer.lr={lr}", f"pipeline.num_steps={steps}", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        refuse("weights", f"the run {run_dir.name} exited {done.returncode}: {last[0]}")
    steps_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if line.endswith("}") and '"summary/' not in line]
    # from step 1: step 0 reports the sync before RL (a warm start's, or none)
    synced = [m for m in steps_ if "weights/delta_ratio" in m and m["step"] >= 1]
    last = synced[-1] if synced else {}
    spans = list(read_spans(spans_path(run_dir)))

    def durations(stage: str, worker_prefix: str) -> list[float]:
        return [s.duration for s in spans if s.stage == stage and s.worker.startswith(worker_prefix)]

    return Figures(
        ratios=[m["weights/delta_ratio"] for m in synced
                if m["weights/delta_bytes"] < m["weights/full_bytes"]],
        steps=len(steps_), delta_loads=int(last.get("weights/delta_loads", 0)),
        fallbacks=int(last.get("weights/delta_fallbacks", 0)),
        attestation=int(max((m.get("faults/attestation", 0) for m in steps_), default=0)),
        full_bytes=float(last.get("weights/full_bytes", 0.0)),
        put_s=median(durations("weights_put", "trainer")),
        encode_s=median(durations("weights_delta", "trainer")),
        load_s=median([s.duration for s in spans if s.stage == "weight_sync"
                       and s.worker != "weight_sync" and s.version]),  # the engine actor's
        sync_s=median([s.duration for s in spans if s.stage == "weight_sync"
                       and s.worker == "weight_sync"]),
    )


def lr_of(name: str, overrides: Sequence[str]) -> float:
    return float(experiment(*overrides, base=base_args(name)).trainer.lr)


def report(label: str, lr: float, delta: Figures, full: Figures | None) -> float:
    """Print one workload's line; the median ratio (nan if no step synced by a delta)."""
    ratio = median(delta.ratios)
    check = "bit-identical (attested every step)" if delta.checked else (
        f"NOT CHECKED: {delta.delta_loads} delta loads in {delta.steps} steps, "
        f"{delta.fallbacks} fallbacks, {delta.attestation} attestation failures")
    spread = f"{min(delta.ratios):.4f}-{max(delta.ratios):.4f}" if delta.ratios else "-"
    print(f"{label} lr={lr:g}: delta_payload_ratio={ratio:.4f} (per step {spread}, "
          f"full {delta.full_bytes / 1e6:.1f} MB); {check}", flush=True)
    sync = (f"  sync: put {delta.put_s:.3f}s + encode {delta.encode_s:.3f}s + engine load "
            f"{delta.load_s:.3f}s (driver's sync {delta.sync_s:.3f}s) with deltas")
    if full is not None:
        sync += (f"; put {full.put_s:.3f}s + engine load {full.load_s:.3f}s (driver's sync "
                 f"{full.sync_s:.3f}s) full")
    print(sync + " (medians over steps)", flush=True)
    return ratio if delta.checked else float("nan")


def workloads(args: argparse.Namespace) -> list[tuple[str, str, tuple[str, ...], float, bool]]:
    """(label, experiment, overrides, lr, with a full run beside it) for each run."""
    if args.smoke:
        return [("toy model (float32)", "smoke", TOY_MODEL, LOW_LR, True)]
    toy_lr, smol_lr = lr_of(*TOY), lr_of(*SMOL)
    return [("toy model (float32)", TOY[0], TOY[1], LOW_LR, True),
            ("toy model (float32)", TOY[0], TOY[1], toy_lr, False),
            ("SmolLM2-135M bf16", SMOL[0], SMOL[1], LOW_LR, True),
            ("SmolLM2-135M bf16", SMOL[0], SMOL[1], smol_lr, False)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="6 steps each")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' directories under this folder")
    parser.add_argument("--address", default=None,
                        help="run on this running Ray cluster (2 CPUs free) instead of a "
                             "local one started for each run")
    add_smoke(parser)
    args = parser.parse_args(argv)
    steps = 4 if args.smoke else 6 if args.quick else args.steps
    if steps < 3:
        refuse("weights", f"--steps {steps}: a delta needs a step before it; use 3 or more")
    if not args.smoke:
        try:
            from orchestrator.models.gguf import packaged_gguf

            packaged_gguf("smollm2")
        except ConfigError as error:
            refuse("weights", f"SmolLM2 cannot be loaded: {error}")
    print(f"launcher=ray, 1 engine actor, {steps} steps per run; shared machine "
          f"({os.cpu_count()} cores)", flush=True)
    ratio = headline_ratio = float("nan")
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        folder = args.keep or Path(tmp)
        for label, name, overrides, lr, with_full in workloads(args):
            delta = run(name, overrides, lr, steps, True, folder, args.address)
            full = (run(name, overrides, lr, steps, False, folder, args.address)
                    if with_full else None)
            ratio = report(label, lr, delta, full)
            if "SmolLM2" in label and lr == LOW_LR:
                headline_ratio = ratio
    headline("delta_payload_ratio", ratio if args.smoke else headline_ratio, digits=4)


if __name__ == "__main__":
    main()
