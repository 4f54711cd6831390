"""``python -m orchestrator experiment=smoke engine=vllm model=hf model.path=<checkpoint>`` as a
user runs it (vLLM's engine processes are spawned from the command line's main module, or
from a Ray actor with ``launcher=ray``): the
run trains, the engine's log-probs agree with the trainer's, and the run directory holds
complete metrics, spans (weight syncs with their bytes) and PolyTrace files; and with
``engine.attest=true`` every version's tokens carry one fingerprint, a new one each version, and
no step finds an attestation failure."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
from helpers import REPO, build_hf_checkpoint, run_spans

from orchestrator.trace.reader import TraceDir

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

pytestmark = pytest.mark.vllm


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_the_pipeline_trains_with_engine_vllm_from_a_local_checkpoint(tmp_path: Path,
                                                                     launcher: str) -> None:
    """launcher=ray puts the vLLM engine in a Ray actor (a local Ray started for the run)."""
    if launcher == "ray":
        pytest.importorskip("ray")
    # head size 64 (vLLM's CPU attention rejects 16)
    checkpoint = build_hf_checkpoint(tmp_path / "ckpt", hidden_size=128, num_heads=2,
                                     intermediate_size=128)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    result = forked.run(  # weight decay: every version's weights differ from the last
        [sys.executable, "-m", "orchestrator", "experiment=smoke", "engine=vllm", "model=hf",
         f"launcher={launcher}",
         f"model.path={checkpoint}", "model.dtype=float32", "model.device=cpu", "logger=none",
         "progress=false", "engine.kv_cache_bytes=256MiB", "engine.enforce_eager=true",
         "engine.attest=true", "trainer.weight_decay=0.1", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps=4" in result.stdout, result.stdout

    metrics = read_jsonl(run_dir / "metrics.jsonl")[:-1]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert [m["policy/version"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert m["reward/mean"] >= 0.0 and m["train/loss"] == m["train/loss"]
        assert m["faults/attestation"] == 0
    diffs = [m["engine/logprob_diff"] for m in metrics if "engine/logprob_diff" in m]
    assert diffs and max(diffs) < 1e-3, diffs
    print(f"engine/logprob_diff over the run: {diffs}")

    spans = run_spans(run_dir)
    assert {"generate", "reward", "train_step", "weight_sync"} <= {s["stage"] for s in spans}
    # the pipeline's weight syncs (with launcher=ray the actors add spans of their own)
    syncs = [s["attributes"] for s in spans
             if s["stage"] == "weight_sync" and "load_seconds" in s["attributes"]]
    assert len(syncs) >= 3 and all(a["bytes"] > 0 and a["load_seconds"] > 0 for a in syncs)

    trace = TraceDir.open(run_dir)
    assert trace.steps() == [0, 1, 2, 3]
    for step in trace.steps():
        assert len(list(trace.workload(step))) == 16  # experiment=smoke's batch
        assert list(trace.packed_lengths(step)) and list(trace.reward_timings(step))

    samples = read_jsonl(run_dir / "samples.jsonl")
    by_version: dict[int, set[str]] = {}
    for segment in (s for sample in samples for s in sample["segments"]):
        by_version.setdefault(segment["version"], set()).add(segment["fingerprint"])
    assert all(len(f) == 1 for f in by_version.values()), by_version  # one per version
    assert len(set.union(*by_version.values())) == len(by_version) > 1
