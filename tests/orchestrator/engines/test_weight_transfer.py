"""``engine.weight_transfer`` and ``launcher.colocate``: the backend each placement gets, one line
naming the key for each that does not fit, and the keys composed from the real ``conf/``
(runs in .venv, no vLLM and no GPU needed; the GPU routes are in ``test_vllm_gpu.py``)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_MODEL, quick_config
from omegaconf import OmegaConf

from orchestrator.config.read import check_target, explain, section
from orchestrator.engines.placement import (
    Placement,
    check_colocation,
    choose_weight_transfer,
    colocated_memory_share,
    device_index,
    engine_memory_share,
)
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.errors import ConfigError
from orchestrator.launch import EngineRecipe, LocalLauncher
from orchestrator.weights.update import WeightUpdate

CPU = Placement()
SHARED = Placement(cuda=True, engine_gpus=(0,), trainer_gpu=0)  # colocated on cuda:0
APART = Placement(cuda=True, engine_gpus=(0,), trainer_gpu=1)  # a GPU each
ELSEWHERE = Placement(cuda=True, engine_gpus=(0,), trainer_here=False)  # launcher=ray, ranks
CPU_TRAINER = Placement(cuda=True, engine_gpus=(0,), trainer_gpu=None)  # model.device=cpu
STRADDLES = Placement(cuda=True, engine_gpus=(0, 1), trainer_gpu=0)  # TP over the trainer's GPU
APART_TP = Placement(cuda=True, engine_gpus=(0, 1), trainer_gpu=2)


@pytest.mark.parametrize(("placement", "auto"), [
    (CPU, "rpc"), (SHARED, "ipc"), (APART, "nccl"), (ELSEWHERE, "rpc"), (CPU_TRAINER, "rpc"),
    (STRADDLES, "rpc"), (APART_TP, "nccl"),
], ids=["cpu", "shared", "apart", "elsewhere", "cpu-trainer", "straddles", "apart-tp"])
def test_auto_chooses_by_placement_and_rpc_always_fits(placement: Placement, auto: str) -> None:
    assert choose_weight_transfer("auto", placement) == auto
    assert choose_weight_transfer("rpc", placement) == "rpc"
    if auto != "rpc":
        assert choose_weight_transfer(auto, placement) == auto


@pytest.mark.parametrize(("asked", "placement", "why"), [
    ("nccl", CPU, "the engine is not on a CUDA GPU"),
    ("ipc", CPU, "the engine is not on a CUDA GPU"),
    ("nccl", SHARED, "share cuda:0 (nccl needs two GPUs)"),
    ("ipc", APART, "are on different GPUs (ipc needs one shared GPU)"),
    ("ipc", ELSEWHERE, "the trainer is in another process"),
    ("nccl", ELSEWHERE, "the trainer is in another process"),
    ("nccl", CPU_TRAINER, "the trainer is not on a GPU"),
    ("ipc", STRADDLES, "is one of the engine's cuda:0,cuda:1"),
    ("nccl", STRADDLES, "is one of the engine's cuda:0,cuda:1"),
])
def test_a_backend_that_does_not_fit_is_one_line_naming_the_key(
        asked: str, placement: Placement, why: str) -> None:
    with pytest.raises(ConfigError) as error:
        choose_weight_transfer(asked, placement)
    message = str(error.value)
    assert message.startswith(f"engine.weight_transfer={asked} does not fit this placement: ")
    assert why in message and "\n" not in message
    assert "use engine.weight_transfer=auto" in message


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^engine.weight_transfer=tcp must be one of "
                                          r"auto, rpc, nccl, ipc$"):
        choose_weight_transfer("tcp", CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
@pytest.mark.parametrize("asked", ["nccl", "ipc"])
def test_the_vllm_engine_refuses_a_gpu_backend_on_cpu_before_it_starts(asked: str) -> None:
    with pytest.raises(ConfigError) as error:  # before vLLM is imported: runs without it too
        VLLMEngine(TINY_MODEL, weight_transfer=asked)  # type: ignore[arg-type]
    assert str(error.value).startswith(f"engine.weight_transfer={asked} does not fit")


def test_colocation_needs_one_gpu_for_both() -> None:
    check_colocation(Placement(colocate=False))
    check_colocation(Placement(cuda=True, engine_gpus=(0,), trainer_gpu=0, colocate=True))
    check_colocation(Placement(cuda=True, engine_gpus=(0,), trainer_here=False, colocate=True))
    with pytest.raises(ConfigError, match=r"^launcher.colocate=true needs a CUDA GPU"):
        check_colocation(Placement(colocate=True))
    with pytest.raises(ConfigError, match=r"^launcher.colocate=true but the trainer \(cuda:1\) "
                                          r"and the engine \(cuda:0\) are not on one GPU"):
        check_colocation(Placement(cuda=True, engine_gpus=(0,), trainer_gpu=1, colocate=True))


def test_a_colocated_engine_leaves_the_trainer_its_resident_memory() -> None:
    gib = 1 << 30
    # 80 GiB GPU, 1.5 B parameters: 16 bytes each, 22.4 GiB, and 10% of the GPU left out
    assert colocated_memory_share(80 * gib, 1_500_000_000) == pytest.approx(
        0.9 - 16 * 1.5e9 / (80 * gib), abs=1e-3)
    assert colocated_memory_share(80 * gib, 135_000_000) > 0.8  # SmolLM2: nearly everything
    with pytest.raises(ConfigError, match=r"^engine.gpu_memory_utilization=auto: a trainer of "
                                          r"7.00 B parameters on the engine's GPU"):
        colocated_memory_share(80 * gib, 7_000_000_000)


@pytest.mark.parametrize(("placement", "beside"), [
    (Placement(cuda=True, engine_gpus=(0,), trainer_gpu=1), False),  # a GPU each
    (Placement(cuda=True, engine_gpus=(0,), trainer_here=False), False),  # Ray, not colocated
    (Placement(cuda=True, engine_gpus=(0,), trainer_gpu=0), True),  # one GPU, not colocated
    (Placement(cuda=True, engine_gpus=(0, 1), trainer_gpu=1), True),  # on one of the engine's
    (Placement(cuda=True, engine_gpus=(0,), trainer_here=False, trainer_gpu=0), True),  # rank 0
    (Placement(cuda=True, engine_gpus=(0,), trainer_here=False, colocate=True), True),
])
def test_auto_memory_leaves_room_for_any_trainer_on_the_engines_gpu(placement: Placement,
                                                                     beside: bool) -> None:
    """Not only under colocation: a trainer beside the engine all the time needs at least what
    a colocated one keeps, or vLLM's 90% fails to start beside its weights."""
    gib = 1 << 30
    share = engine_memory_share(placement, 80 * gib, 1_500_000_000)
    assert placement.trainer_beside is beside
    assert share == (colocated_memory_share(80 * gib, 1_500_000_000) if beside else 0.9)


def test_engines_sharing_a_gpu_each_plan_for_their_part() -> None:
    gib = 1 << 30
    half = Placement(cuda=True, engine_gpus=(0,), trainer_here=False, gpu_fraction=0.5)
    assert engine_memory_share(half, 80 * gib, 1_500_000_000) == 0.45  # two engines at 0.5
    both = replace(half, colocate=True)
    assert engine_memory_share(both, 80 * gib, 1_500_000_000) == pytest.approx(
        colocated_memory_share(80 * gib, 1_500_000_000) / 2, abs=1e-3)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
@pytest.mark.parametrize(("options", "fraction"), [
    ({"engine": {"num_gpus": 1}}, 1.0),
    ({"engine": {"num_gpus": 2}}, 1.0),  # tensor parallel: a GPU per worker
    ({"engine": {"num_gpus": 0.5}, "num_engines": 2}, 0.5),
    ({"engine": {"num_cpus": 1}}, 1.0),  # no GPU: nothing to share
    ({"colocate": True, "num_engines": 2, "trainer": {"num_gpus": 0.5},
      "engine": {"num_gpus": 0.25}}, 0.5),  # what the trainer leaves, split
])
def test_ray_tells_each_engine_its_part_of_a_shared_gpu(options: dict, fraction: float) -> None:
    from orchestrator.launch.ray import RayLauncher

    placement = RayLauncher(**options).engine_placement()
    assert placement.gpu_fraction == fraction and not placement.trainer_here


@pytest.mark.parametrize(("device", "cuda", "index"), [
    ("cpu", True, None), ("auto", False, None), ("auto", True, 0), ("cuda", True, 0),
    ("cuda:1", True, 1),
])
def test_the_trainers_gpu_is_read_from_model_device(device: str, cuda: bool,
                                                    index: int | None) -> None:
    assert device_index(device, cuda) == index


# -- launcher.colocate ---------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
def test_colocate_without_a_gpu_fails_before_anything_starts(tmp_path) -> None:
    from orchestrator.builders import run

    cfg = quick_config("smoke", "launcher.colocate=true")
    with pytest.raises(Exception) as error:
        run(cfg, tmp_path / "run")
    assert explain(error.value) == ("launcher.colocate=true needs a CUDA GPU for the trainer and "
                                    "the engine to share, and none is visible: set "
                                    "launcher.colocate=false")
    assert not (tmp_path / "run").exists()  # nothing built, nothing written


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_colocation_refuses_finishing_episodes_before_the_sync() -> None:
    """A colocated engine sleeps through the train step with its requests in flight; the
    sync that wakes it would wait for them to finish first: a deadlock, refused up front."""
    from orchestrator.builders import training_parts
    from orchestrator.config.run import run_config
    from orchestrator.launch.ray import RayLauncher

    launcher = RayLauncher(colocate=True, trainer={"num_gpus": 0.5}, engine={"num_gpus": 0.5})
    with pytest.raises(ConfigError) as error:  # before Ray starts or anything is built
        training_parts(run_config(quick_config("smoke", "pipeline.inflight_update=finish")),
                       launcher)
    assert str(error.value).startswith("pipeline.inflight_update=finish cannot run with "
                                       "launcher.colocate=true")


def test_a_trainer_in_another_process_than_its_colocated_engine_gives_back_cached_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine empties torch's cache in its own process before it wakes; a trainer actor or
    rank must empty its own, or the wake finds the step's peak still held."""
    from orchestrator.launch import TrainerRecipe
    from orchestrator.launch.ranks import RankServer

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    recipe = TrainerRecipe(trainer={}, model=TINY_MODEL, algo={})
    recipe.release_cached_memory()
    assert emptied == []  # not colocated: the cache stays for the next step
    colocated = replace(recipe, colocated=True)
    colocated.release_cached_memory()
    assert emptied == [True]
    server = RankServer.__new__(RankServer)  # a rank's server, around a stand-in trainer
    server.recipe, server.trainer = colocated, SimpleNamespace(
        version=3, train_step=lambda groups: {"loss": 0.0}, gather=lambda: None)
    server.step([])
    server.gather()
    assert emptied == [True] * 3


def test_the_local_launcher_tells_the_engine_where_the_trainer_is() -> None:
    recipe = EngineRecipe(engine={}, model={**TINY_MODEL, "device": "cuda:1"})
    with LocalLauncher() as launcher:
        placement = launcher.placement(recipe)
    assert placement == Placement(trainer_here=True, trainer_gpu=1, colocate=False)
    on_cpu = LocalLauncher().placement(EngineRecipe(engine={}, model=TINY_MODEL))
    assert on_cpu.trainer_gpu is None
    launcher = LocalLauncher()
    launcher._trainer_here = False  # trainer ranks: rank 0 takes model.device's GPU
    assert launcher.placement(recipe) == Placement(trainer_here=False, trainer_gpu=1)


@pytest.mark.anyio
async def test_an_engine_without_a_placement_argument_is_built_as_before(tiny) -> None:
    cfg = quick_config("smoke", "engine=torch")
    recipe = EngineRecipe(engine=section(cfg, "engine"), model=TINY_MODEL,
                          placement=Placement(colocate=True))
    async with recipe.build(WeightUpdate.of_module(3, tiny.model)) as engine:  # takes none
        assert engine.version == 3
        await engine.sleep()  # the default: nothing


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
@pytest.mark.parametrize(("trainer", "engine", "engines"), [
    (0, 0, 1), (0.5, 0, 1), (0.5, 0.5, 2), (1, 0.5, 1),
])
def test_ray_colocation_asks_for_fractions_of_one_gpu(trainer: float, engine: float,
                                                       engines: int) -> None:
    from orchestrator.launch.ray import RayLauncher

    with pytest.raises(ConfigError) as error:  # checked in the constructor: Ray not started
        RayLauncher(num_engines=engines, colocate=True, trainer={"num_gpus": trainer},
                    engine={"num_gpus": engine})
    assert str(error.value).startswith("launcher.colocate=true needs the trainer and the "
                                       "engines on one GPU")
    RayLauncher(num_engines=2, colocate=True, trainer={"num_gpus": 0.5},
                engine={"num_gpus": 0.25})  # fits: nothing raised


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_ray_gives_a_tensor_parallel_engine_its_gpus_or_says_so() -> None:
    from orchestrator.launch.ray import RayLauncher

    recipe = EngineRecipe(engine={"tensor_parallel_size": 2}, model=TINY_MODEL)
    with pytest.raises(ConfigError) as error:  # before any actor is asked for
        RayLauncher(engine={"num_gpus": 1}).engine(recipe, WeightUpdate.by_reference(0, {}))
    assert str(error.value) == (
        "engine.tensor_parallel_size=2 splits each engine over 2 GPUs of its actor, which "
        "launcher.engine.num_gpus=1 does not give it: set launcher.engine.num_gpus=2")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_ray_trainer_ranks_on_gpus_take_a_whole_gpu_each() -> None:
    """Ray packs fractions of a GPU onto one device; NCCL refuses two ranks on one device."""
    from orchestrator.launch.ray import RayLauncher

    with pytest.raises(ConfigError) as error:
        RayLauncher(trainer_ranks=2, trainer={"num_gpus": 0.5}, engine={"num_cpus": 1})
    assert str(error.value).startswith("trainer.world_size=2 with launcher.trainer.num_gpus=0.5: "
                                       "Ray may put two ranks on one GPU")
    with pytest.raises(ConfigError) as error:
        RayLauncher(trainer_ranks=2, colocate=True, trainer={"num_gpus": 0.25},
                    engine={"num_gpus": 0.5})
    assert str(error.value).startswith("launcher.colocate=true shares one GPU, which holds one "
                                       "trainer rank, not trainer.world_size=2")
    for share in (0, 1):  # CPU ranks over gloo, or a GPU each: nothing raised
        RayLauncher(trainer_ranks=2, trainer={"num_gpus": share, "num_cpus": 1})
    RayLauncher(trainer_ranks=1, colocate=True, trainer={"num_gpus": 0.5},
                engine={"num_gpus": 0.5})


# -- the real conf/ ------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_the_new_keys_compose_from_conf(launcher: str) -> None:
    cfg = quick_config("smoke", "engine=vllm", f"launcher={launcher}")
    assert cfg.engine.weight_transfer == "auto" and cfg.engine.gpu_memory_utilization == "auto"
    assert cfg.launcher.colocate is False
    check_target(cfg, "engine")
    if launcher == "local" or importlib.util.find_spec("ray") is not None:
        check_target(cfg, "launcher")
    cfg = quick_config("smoke", "engine=vllm", "engine.weight_transfer=ipc",
                       f"launcher={launcher}", "launcher.colocate=true",
                       "engine.gpu_memory_utilization=0.4")
    assert OmegaConf.select(cfg, "engine.weight_transfer") == "ipc"
    assert cfg.launcher.colocate is True
    check_target(cfg, "engine")


@pytest.mark.parametrize(("override", "message"), [
    ("engine.weight_transfer=tcp",
     "engine.weight_transfer=tcp must be 'auto' or 'rpc' or 'nccl' or 'ipc'"),
    ("engine.gpu_memory_utilization=most",
     "engine.gpu_memory_utilization=most must be a number or 'auto'"),
    ("launcher.colocate=maybe", "launcher.colocate=maybe must be true or false"),
])
def test_a_wrong_value_is_named_where_the_other_keys_are(override: str, message: str) -> None:
    cfg = quick_config("smoke", "engine=vllm", override)
    key = override.split(".")[0]
    with pytest.raises(ConfigError) as error:
        check_target(cfg, key)
    assert str(error.value) == message
