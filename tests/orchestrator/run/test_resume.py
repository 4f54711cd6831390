"""Crash and resume, with real processes and real signals: a short run is SIGKILLed at a chosen
point (``POLYRL_KILL_AT``, orchestrator/faults.py) or sent SIGTERM, then resumed with
``python -m orchestrator resume=<run_dir>`` to its end. Also the atomic checkpoint store, the
task sampler's state, and the refusal of overrides that would change a resumed run's maths."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import REPO, run_spans

from envs.base import Task
from orchestrator.errors import ConfigError
from orchestrator.faults import add_faults, resumed_faults
from orchestrator.pipeline.pipeline import TaskSampler
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.run.directory import faults_recorded
from orchestrator.run.resume import RunState, find_checkpoint, resumed_config
from orchestrator.trace.reader import TraceDir

STEPS = 6
# experiment=smoke made smaller still: a one-layer model, two warm-start steps, a small eval
RUN = ["experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
       "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
       "warmstart.steps=2", "eval.num_tasks=8", f"pipeline.num_steps={STEPS}",
       "checkpoint.every=1", "checkpoint.keep=3"]


def orchestrator(*args: str, kill_at: str | None = None, wait: bool = True
                 ) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    if kill_at:
        env["POLYRL_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "orchestrator", *args]
    if not wait:
        return forked.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return forked.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
                      check=False)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_prompts(run_dir: Path) -> list[int]:
    trace = TraceDir.open(run_dir)
    return [r.prompt_group_id for step in trace.steps() for r in trace.workload(step)
            if r.sample_id == 0]


TRAIN_TASKS = 4000  # experiment=smoke's train split


def check_finished(run_dir: Path, again: set[int], resumed_at: int = 0) -> None:
    """Steps and versions go on with no gap or repeat; no prompt is trained twice; every prompt
    in flight at the checkpoint resumed from (``again``) was rolled out again: trained, or
    still in flight when the run reached its last step (the last checkpoint's sampler lists
    those: no step was left to train them, as at the end of any run); and every prompt the
    sampler handed out is accounted for once, from the run's own files."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "summary/steps" not in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert [m["policy/version"] for m in steps] == list(range(STEPS))
    assert all(m["staleness/max"] <= 1 for m in steps)  # k = 1 across the resume
    prompts = trained_prompts(run_dir)
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    dropped = steps[-1]["staleness/dropped_total"]
    assert len(prompts) == STEPS * 4  # 4 groups of 4 per step
    last = RunState.read(find_checkpoint(run_dir))
    assert last.step == STEPS  # every run ends with a checkpoint of its last step
    sampler = last.pipeline["sampler"]
    in_flight = set(sampler["again"])  # handed out, not trained, when the run ended
    assert not in_flight & set(prompts)
    if not dropped:
        lost = again - set(prompts) - in_flight
        assert not lost, f"prompts in flight at the crash were lost: {lost}"
        assert sampler["passes"] == 1
        handed_out = TRAIN_TASKS - len(sampler["order"])
        assert handed_out == len(prompts) + len(in_flight), "a prompt handed out was lost"
    trace = TraceDir.open(run_dir)
    assert trace.steps() == list(range(STEPS))
    for step in trace.steps():
        assert len(list(trace.workload(step))) == 16
    assert run_spans(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval_after"] is not None  # the whole run
    assert summary["eval_before"] is not None and summary["resumes"] >= 1
    assert summary["checkpoints"] >= 1 and summary["checkpoint_pause_s"] > 0
    if resumed_at < STEPS:  # the resumed process recorded steps: they count the resume
        assert steps[-1]["faults/resumes"] == 1


@pytest.mark.parametrize("kill_at", ["generate@2", "train_step@2", "weight_sync@3", "checkpoint@3"])
@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_run_killed_at_any_point_resumes_to_the_end(tmp_path: Path, kill_at: str) -> None:
    run_dir = tmp_path / "run"
    killed = orchestrator(*RUN, f"hydra.run.dir={run_dir}", kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    checkpoint = find_checkpoint(run_dir)
    state = RunState.read(checkpoint)
    # a checkpoint is written in the background: the kill may cut one short (then the one
    # before it, possibly step 0's after the warm start, is the one resumed from)
    assert 0 <= state.step < STEPS and state.version == state.step
    if kill_at.startswith("checkpoint"):  # the half-written one is not the one resumed from
        assert list((run_dir / "checkpoints").glob(".tmp-step-*"))
    resumed = orchestrator(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"steps={STEPS} " in resumed.stdout  # the summary covers the whole run
    assert "Traceback" not in resumed.stderr
    check_finished(run_dir, set(state.pipeline["sampler"]["again"]))
    assert not list((run_dir / "checkpoints").glob(".tmp-step-*"))


# orchestrator/pipeline/outcomes.py
OUTCOMES_SETTLED = ("trained", "stale", "filtered", "masked", "empty")


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_dynamic_sampling_killed_and_resumed_neither_repeats_nor_skips_a_prompt(
        tmp_path: Path) -> None:
    """algo/filter=dynamic_sampling at k = 1, SIGKILLed mid-step and resumed. An untrained
    model's groups mostly have equal rewards, so most prompts are filtered. Every prompt the
    run judged (trained, filtered, dropped) is counted once in the steps' metrics, and the
    sampler of the last checkpoint has settled exactly as many: a prompt judged twice (a
    filtered one rolled out again after the resume) or lost (in flight at the crash and never
    rolled out again) would break the equality."""
    run_dir = tmp_path / "run"
    args = [*RUN, "algo/filter=dynamic_sampling", "algo.filter.max_refill_batches=1"]
    killed = orchestrator(*args, f"hydra.run.dir={run_dir}", kill_at="train_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # resume from the latest checkpoint with prompts in flight, as when the ones after it are
    # cut short: on a loaded machine the last one can catch a moment with none (CI's full run
    # once left step-3's with none, step-1's and step-2's with four each)
    kept = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    in_flight = [c for c in kept if RunState.read(c).pipeline["sampler"]["again"]]
    assert in_flight, [RunState.read(c).pipeline["sampler"] for c in kept]
    for later in kept[kept.index(in_flight[-1]) + 1:]:
        shutil.rmtree(later)
    assert find_checkpoint(run_dir) == in_flight[-1]
    resumed = orchestrator(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr

    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "summary/steps" not in m]
    assert [m["step"] for m in steps] == [m["policy/version"] for m in steps] == list(range(STEPS))
    assert all(m["staleness/max"] <= 1 for m in steps)  # k = 1 across the resume
    prompts = trained_prompts(run_dir)
    assert len(prompts) == len(set(prompts)) == STEPS * 4, "a prompt was trained twice"
    judged = sum(m[f"groups/{o}"] for m in steps for o in OUTCOMES_SETTLED)
    filtered = sum(m["filter/refills"] for m in steps)
    assert filtered > 0 and all(m["groups/unfinished"] == 0 for m in steps)
    last = RunState.read(find_checkpoint(run_dir))
    assert last.step == STEPS
    sampler = last.pipeline["sampler"]
    assert sampler["passes"] == 1  # one pass over the 4000 tasks: settled = handed out - again
    settled = 4000 - len(sampler["order"]) - len(sampler["again"])
    assert judged == settled


@pytest.mark.parametrize("version", [2, STEPS - 1])
@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_sigterm_checkpoints_the_step_in_progress_and_exits_with_one_line(
        tmp_path: Path, version: int) -> None:
    """SIGTERM during a train step (placed by the run's progress, not a clock): the run stops
    after that step with its checkpoint and one line, and the resume finishes it. During the
    last step (``STEPS - 1``) no step is left after the resume to roll the prompts in flight
    out again: they stay in flight, listed by the last checkpoint, and are not lost. (The
    earlier form of this test sent SIGTERM from outside once two steps were recorded; on a
    busy machine the signal landed in the last step and the test took those prompts for lost.)"""
    run_dir = tmp_path / "run"
    stopped = orchestrator(*RUN, "checkpoint.every=0", f"hydra.run.dir={run_dir}",
                           kill_at=f"train_step@{version}:TERM")
    assert isinstance(stopped, subprocess.CompletedProcess)
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert stopped.returncode == 2 and len(errors) == 1, stopped.stderr[-2000:]
    assert f"stopped by SIGTERM after {version + 1} steps" in errors[0]
    assert f"resume={run_dir}" in errors[0]
    assert "Traceback" not in stopped.stderr
    state = RunState.read(find_checkpoint(run_dir))
    recorded = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "summary/steps" not in m]
    assert state.step == len(recorded) == version + 1
    again = set(state.pipeline["sampler"]["again"])
    assert again  # prompts were in flight (k = 1 admits the next step's groups)
    resumed = orchestrator(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_finished(run_dir, again, resumed_at=state.step)
    if version == STEPS - 1:  # none could be trained: all still in flight at the end
        assert again == set(RunState.read(find_checkpoint(run_dir)).pipeline["sampler"]["again"])


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_finished_run_resumed_says_so_and_trains_only_when_asked_for_more(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = orchestrator(*RUN, "checkpoint.every=0", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-2000:]
    final = (run_dir / "checkpoints" / "final" / "trainer.pt").stat().st_mtime_ns
    assert RunState.read(find_checkpoint(run_dir)).step == STEPS  # the end's checkpoint
    again = orchestrator(f"resume={run_dir}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == (
        f"resume={run_dir}: the run finished at step {STEPS} (its model: "
        f"{run_dir}/checkpoints/final); nothing to train. To train it further, resume with "
        f"more steps, e.g. pipeline.num_steps={2 * STEPS}")
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS + 1  # nothing trained again
    assert (run_dir / "checkpoints" / "final" / "trainer.pt").stat().st_mtime_ns == final
    more = orchestrator(f"resume={run_dir}", f"pipeline.num_steps={STEPS + 2}")
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resuming at step 6 " in more.stderr  # from its end, no step trained twice
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "summary/steps" not in m]
    assert [m["step"] for m in steps] == list(range(STEPS + 2))
    assert f"steps={STEPS + 2} " in more.stdout


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_resume_auto_starts_a_run_then_resumes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = orchestrator(*RUN, "resume=auto", f"hydra.run.dir={run_dir}", kill_at="train_step@3")
    assert first.returncode == -signal.SIGKILL
    again = orchestrator(*RUN, "resume=auto", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    check_finished(run_dir, set())


def test_resume_refuses_a_directory_without_a_checkpoint_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    result = orchestrator(f"resume={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: resume={tmp_path}: the run directory has no complete checkpoint to resume from "
        f"(it stopped before its first); to start it again there, run the same command with "
        f"resume=auto hydra.run.dir={tmp_path}")


def test_resume_allows_only_keys_that_cannot_change_the_maths(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        "pipeline: {num_steps: 4, batch_size: 16}\nprogress: true\nlogger: {_target_: x}\n")
    cfg = resumed_config(tmp_path, ["pipeline.num_steps=9", "progress=false", "logger=none",
                                    "hydra.run.dir=/elsewhere"])
    assert cfg.pipeline.num_steps == 9 and cfg.progress is False
    assert cfg.logger._target_ == "orchestrator.loggers.base.NullLogger"
    with pytest.raises(ConfigError, match=r"^pipeline.batch_size cannot change when resuming"):
        resumed_config(tmp_path, ["pipeline.batch_size=32"])


# -- the checkpoint store ----------------------------------------------------------------------


def write_files(directory: Path, size: int = 100) -> None:
    (directory / "model").mkdir()
    (directory / "model" / "weights.bin").write_bytes(bytes(size))
    (directory / "state.json").write_text("{}")


def test_the_store_keeps_the_newest_and_ignores_an_unfinished_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(step, write_files)
    assert store.steps() == [2, 3]
    (tmp_path / "step-4").mkdir()  # a crash before the manifest: never a candidate
    write_files(tmp_path / "step-4")
    assert store.steps() == [2, 3] and store.latest_valid() == tmp_path / "step-3"


def test_a_corrupt_checkpoint_is_skipped_with_one_line(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, write_files)
    store.save(2, write_files)
    weights = tmp_path / "step-2" / "model" / "weights.bin"
    weights.write_bytes(bytes(50))  # truncated
    assert store.latest_valid() == tmp_path / "step-1"
    assert "skipping checkpoint" in caplog.text and "weights.bin has 50 bytes" in caplog.text
    (tmp_path / "step-1" / "state.json").unlink()
    assert store.latest_valid() is None
    assert "state.json is missing" in caplog.text


# -- the task sampler --------------------------------------------------------------------------


def tasks(n: int) -> list[Task]:
    return [Task(id=i, messages=({"role": "user", "content": str(i)},), answer="") for i in range(n)]


def test_prompts_in_flight_at_a_checkpoint_are_handed_out_again_first() -> None:
    sampler = TaskSampler(tasks(20), seed=3)
    taken = [sampler.next().id for _ in range(6)]
    for task_id in taken[:4]:
        sampler.settle(task_id)  # trained; taken[4:] are in flight
    state = json.loads(json.dumps(sampler.state_dict()))  # it goes through JSON
    rest = [sampler.next().id for _ in range(14)]

    restored = TaskSampler(tasks(20), seed=999)
    restored.load_state_dict(state)
    again = [restored.next().id for _ in range(16)]
    assert again[:2] == taken[4:]  # in flight: rolled out again
    assert again[2:] == rest  # then the pass goes on where it was
    assert sorted(taken[:4] + again) == list(range(20))  # none skipped, none repeated
    assert restored.passes == 1


def test_fault_counters_are_the_whole_runs_across_resumes(tmp_path: Path) -> None:
    """A resume starts from the larger of the checkpoint's counters and the last recorded
    before the crash (in records the resume cuts), plus itself; later steps add this
    process's counts to them."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "faults/engine_restarts": 1.0, "faults/sandbox_lost": 0.0}\n'
        '{"step": 1, "faults/engine_restarts": 2.0, "faults/sandbox_lost": 1.0}\n'
        '{"step": 2, "faults/engine_')  # cut short by the crash
    recorded = faults_recorded(tmp_path)
    assert recorded == {"faults/engine_restarts": 2.0, "faults/sandbox_lost": 1.0}
    checkpoint = {"faults/engine_restarts": 1.0, "faults/resumes": 1.0}  # of step 0
    before = resumed_faults(checkpoint, recorded)
    assert before == {"faults/engine_restarts": 2.0, "faults/sandbox_lost": 1.0,
                      "faults/resumes": 2.0}
    now = {"faults/engine_restarts": 1.0, "faults/docker_unreachable": 1.0, "engine/x": 5.0}
    assert add_faults(before, now) == {
        "faults/docker_unreachable": 1.0, "faults/engine_restarts": 3.0,
        "faults/resumes": 2.0, "faults/sandbox_lost": 1.0}


def test_rng_state_round_trips(tmp_path: Path) -> None:
    import random

    import numpy as np

    from orchestrator.run.resume import capture_rng, restore_rng

    RunState(pipeline={"step": 1, "dropped": 0, "sampler": {}}, version=1).write(tmp_path, capture_rng())
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(tmp_path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_cuda_generators_go_back_onto_the_gpus_this_machine_has(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run saved on 2 GPUs resumes on 1: its first generator goes back, the second has no
    GPU (set_rng_state_all would have asked CUDA for a device 1 and failed)."""
    from orchestrator.run.resume import capture_rng, restore_rng

    state = capture_rng()
    state["cuda"] = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    RunState(pipeline={"step": 1, "dropped": 0, "sampler": {}}, version=1).write(tmp_path, state)
    restored: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda generator, device: restored.append((int(generator[0]), device)))
    restore_rng(tmp_path)
    assert restored == [(1, 0)]


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_resumed_run_continues_the_same_offline_wandb_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [a for a in RUN if not a.startswith("logger=")] + ["logger=wandb", "logger.mode=offline"]
    killed = orchestrator(*args, f"hydra.run.dir={run_dir}", kill_at="train_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = RunState.read(find_checkpoint(run_dir))
    assert state.logger_run_id
    resumed = orchestrator(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{state.logger_run_id}") for r in runs)


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_killed_and_resumed_ends_within_noise_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """Same seed, same config: one run straight through, one SIGKILLed mid-step and resumed.
    One-digit sums and a longer warm start make the held-out accuracy informative (~0.6)."""
    args = [*RUN, "warmstart.steps=80", "env.digits=1", "env.train_size=70", "env.eval_size=30",
            "eval.num_tasks=30", "model.hidden_size=128", "model.num_layers=4",
            "model.intermediate_size=512"]
    straight = orchestrator(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = orchestrator(*args, f"hydra.run.dir={tmp_path / 'killed'}", kill_at="train_step@3")
    assert killed.returncode == -signal.SIGKILL
    resumed = orchestrator(f"resume={tmp_path / 'killed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((tmp_path / "straight" / "summary.json").read_text())["eval_after"]
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())["eval_after"]
    print(f"held-out accuracy: uninterrupted {a:.3f}, killed and resumed {b:.3f}")
    p = max((a + b) / 2, 0.05)
    noise = 3 * (2 * p * (1 - p) / 30) ** 0.5  # three standard errors of a difference
    assert abs(a - b) <= noise, (a, b, noise)


def test_a_snapshot_is_a_copy_that_reuses_the_last_ones_memory(tiny, make_policy,
                                                               tmp_path: Path) -> None:
    """Training after a snapshot leaves it alone; the next snapshot copies into the last one's
    tensors (already written) and holds the new state; a written snapshot loads back exactly."""
    from orchestrator.algo.grpo import GRPO
    from orchestrator.trainer import TorchTrainer

    trainer = TorchTrainer(tiny, GRPO())

    def train() -> None:
        ids = torch.randint(0, tiny.tokenizer.vocab_size, (2, 8))
        tiny.model(input_ids=ids, labels=ids).loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    train()
    first = trainer.snapshot()
    kept = {k: v.clone() for k, v in first.weights.items()}
    train()  # the live tensors change; the snapshot does not
    assert all(torch.equal(first.weights[k], kept[k]) for k in kept)
    pointers = {k: v.data_ptr() for k, v in first.weights.items()}
    second = trainer.snapshot()  # into the first one's tensors
    live = tiny.model.state_dict()
    assert all(torch.equal(second.weights[k], live[k]) for k in second.weights)
    assert {k: v.data_ptr() for k, v in second.weights.items()} == pointers  # reused
    second.write(tmp_path / "ckpt")
    other = TorchTrainer(make_policy(1), GRPO())
    other.load(tmp_path / "ckpt")
    assert all(torch.equal(other.model.state_dict()[k], live[k]) for k in live)
    moments = other.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, trainer.optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_pickled_snapshot_carries_its_tensors_out_of_band_and_restores_into_owned_memory(
        tiny, make_policy) -> None:
    """Pickled (as Ray's object store does: protocol 5, buffers out of band), a snapshot's
    tensors leave as buffers, not as torch.save bytes in the pickle; unpickled over read-only
    memory, it restores a trainer that then trains without writing into that memory."""
    import pickle

    from orchestrator.algo.grpo import GRPO
    from orchestrator.trainer import TorchTrainer

    trainer = TorchTrainer(tiny, GRPO())

    def train(t: TorchTrainer) -> None:
        ids = torch.randint(0, tiny.tokenizer.vocab_size, (2, 8))
        t.model(input_ids=ids, labels=ids).loss.backward()
        t.optimizer.step()
        t.optimizer.zero_grad()

    train(trainer)
    snapshot = trainer.snapshot()
    snapshot.weights["bf16"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)  # no numpy type
    tensors = [*snapshot.weights.values(), *[v for s in snapshot.state["optimizer"]["state"].values()
                                              for v in s.values()]]
    buffers: list[pickle.PickleBuffer] = []
    inband = pickle.dumps(snapshot, protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == sum(t.numel() * t.element_size() for t in tensors)
    assert len(inband) < 0.05 * sum(b.raw().nbytes for b in buffers)
    # the buffers as read-only memory, as ray.get hands them
    read_only = [memoryview(bytes(b.raw())).toreadonly() for b in buffers]
    back = pickle.loads(inband, buffers=read_only)
    assert back.borrowed and back.weights.keys() == snapshot.weights.keys()
    for k, v in snapshot.weights.items():
        assert back.weights[k].dtype == v.dtype and torch.equal(back.weights[k], v), k
    before = [bytes(m) for m in read_only]
    del back.weights["bf16"]
    other = TorchTrainer(make_policy(1), GRPO())
    other.restore(back)
    moments = other.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, trainer.optimizer.state_dict()["state"][0]["exp_avg"])
    train(other)  # Adam writes its moments: into memory of the trainer's own
    assert [bytes(m) for m in read_only] == before


def test_a_run_killed_before_its_first_checkpoint_starts_again_and_counts_the_restart(
        tmp_path: Path) -> None:
    """resume=auto finds no checkpoint: the run starts from the beginning in its directory, the
    killed attempt's steps are cut, and its fault counters go on with the restart counted."""
    from helpers import quick_config

    from orchestrator.builders import run

    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "faults/sandbox_lost": 2.0}) + "\n"
        + json.dumps({"step": 1, "faults/sandbox_lost": 3.0}) + "\n")
    run(quick_config("smoke", "logger=none"), tmp_path)
    records = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "step" in m]
    steps = [m["step"] for m in records if "summary/steps" not in m]
    assert steps == sorted(set(steps)) and steps[0] == 0  # the attempt's steps were cut
    last = [m for m in records if "summary/steps" not in m][-1]
    assert last["faults/resumes"] == 1 and last["faults/sandbox_lost"] == 3
