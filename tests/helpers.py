"""Helpers shared by tests: a scripted simulated engine (it replies with a function of the
prompt) and a composed config for a seconds-long run of any experiment."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from orchestrator.engines.simulated import ScriptedReplies, SimulatedEngine
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import Policy
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.trace.recorder import Span, read_spans, spans_path
from orchestrator.trainer.batch import shared_prefix
from orchestrator.types import FinishReason, Group, Trajectory
from orchestrator.weights.update import WeightUpdate

TOK = CharTokenizer()
# The tests' tiny model as a conf/model node: engines are built from it, never from a policy.
TINY_MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 32,
              "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "device": "cpu"}
# The vLLM engine tests' model (head size 32: vLLM's CPU attention rejects 16) and engine: the
# KV cache in bytes (a share of NUMA node 0 depends on the machine, and fails where it is small).
VLLM_TINY_MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 64,
                   "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
                   "max_position_embeddings": 256, "dtype": "float32", "device": "cpu", "seed": 0}
VLLM_ENGINE = {"kv_cache_bytes": "256MiB", "max_num_seqs": 32, "enforce_eager": True}
REPO = Path(__file__).resolve().parents[1]


def scripted_engine(reply: Callable[[list[int]], str], version: int = 3) -> SimulatedEngine:
    """The simulated engine replying ``reply(prompt)`` (then the first stop token) in no time,
    log-prob -0.5 per token; ``engine.replies.prompts`` and ``.sampling`` are what it was
    asked."""
    return SimulatedEngine(ScriptedReplies(reply, TOK), seconds_per_token=0.0,
                           chunk_tokens=1 << 20, version=version)


@pytest.fixture(name="anyio_backend")
def virtual_time() -> tuple[str, dict[str, Any]]:
    """A module's ``anyio_backend`` when imported there: trio with a clock that jumps to the
    next timer whenever every task waits, so simulated waits order events exactly and take no
    real time (what :func:`orchestrator.replay.run.run_virtual` runs a replay under)."""
    from trio.testing import MockClock

    return "trio", {"clock": MockClock(autojump_threshold=0)}


@contextmanager
def threads_held() -> Iterator[anyio.CapacityLimiter]:
    """Every free token of anyio's default thread limiter held: a task that tries to start a
    worker thread meanwhile (a decode step, an optimiser step) waits for one instead, and
    ``limiter.statistics().tasks_waiting`` counts it. With
    :func:`anyio.wait_all_tasks_blocked` that proves, without waiting "long enough", that
    nothing started computing: everything runnable ran and parked somewhere else."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    holders: list[object] = []
    while limiter.available_tokens >= 1:
        holders.append(object())
        limiter.acquire_on_behalf_of_nowait(holders[-1])
    try:
        yield limiter
    finally:
        for holder in holders:
            limiter.release_on_behalf_of(holder)


def engine_for(policy: Policy, cls: type[TorchEngine] | None = None, **kwargs: Any) -> TorchEngine:
    """A torch engine built from the tiny model's config, starting from ``policy``'s weights."""
    return (cls or TorchEngine)(TINY_MODEL, WeightUpdate.of_module(0, policy.model), **kwargs)


def peak_concurrency(spans: Sequence[Span]) -> int:
    """The most spans open at once."""
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    peak = running = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def quick_config(experiment: str, *overrides: str) -> DictConfig:
    """``experiment`` shrunk to a run of seconds: a one-layer model, two steps of 8 samples."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            f"experiment={experiment}", "logger=none", "progress=false", "model.device=cpu",
            "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
            "pipeline.num_steps=2", "pipeline.batch_size=8", "pipeline.num_workers=2",
            "warmstart.steps=2", "warmstart.target_accuracy=null", "eval.num_tasks=4",
            "env.train_size=32", "env.eval_size=4", *overrides])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_hf_checkpoint(path: Path, hidden_size: int = 32, num_heads: int = 2,
                        intermediate_size: int = 64, num_layers: int = 1) -> Path:
    """A tiny Qwen2 checkpoint with a byte-level BPE tokenizer and a chat template, built
    offline into ``path`` (the tokenizer is trained on a few lines of arithmetic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"{a:02d}+{b:02d}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 9)]
    bpe.train_from_iterator(corpus + ["user assistant system"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def group_prefixes(sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]],
                   group: Sequence[int]) -> list[int]:
    """Each row's shared, untrained prefix within its group (as the trainer packs groups)."""
    return [shared_prefix([s for s, h in zip(sequences, group, strict=True) if h == g],
                          [m for m, h in zip(masks, group, strict=True) if h == g])
            for g in group]


def run_spans(run_dir: Path) -> list[dict[str, Any]]:
    """A run directory's spans as JSON objects, wherever and however it stores them."""
    return [{"stage": s.stage, "worker": s.worker, "start": s.start, "end": s.end,
             "version": s.version, "attributes": s.attributes}
            for s in read_spans(spans_path(run_dir))]


def run_step_files(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """A run directory's PolyTrace records by published file name (``<kind>_step_N.jsonl``),
    read through the trace reader whatever the layout or compression."""
    from orchestrator.trace.reader import TraceDir

    trace = TraceDir.open(run_dir)
    return {f"{kind}_step_{step}.jsonl": [r.to_dict() for r in trace.records(kind, step)]
            for kind, steps in trace.files.items() for step in steps}


_ray_nodes: Any = None  # the process's Ray cluster, while Ray's tests run


def ray_nodes() -> Any:
    """One real local multi-node Ray cluster (``ray.cluster_utils.Cluster``) for every test of
    this process that runs Ray in it: a head with the ``head_node`` resource and two worker
    nodes with ``engine_node`` and ``trainer_node``, one CPU each. Tests place actors with those
    resources (a trainer on the head and an engine on each worker node, or an engine on the
    head and a trainer rank on each). Started on first use; conftest.py shuts it down after
    the last test of Ray's group (:func:`stop_ray_nodes`). One cluster, not one per test file:
    each start costs seconds of CPU."""
    from ray.cluster_utils import Cluster

    global _ray_nodes
    if _ray_nodes is None:
        cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 1, "resources": {"head_node": 1}, "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"engine_node": 1, "trainer_node": 1})
        cluster.wait_for_nodes()
        _ray_nodes = cluster
    return _ray_nodes


def stop_ray_nodes() -> None:
    """Shut :func:`ray_nodes`' cluster down, if it runs (and this process's connection)."""
    global _ray_nodes
    if _ray_nodes is None:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _ray_nodes.shutdown()
    _ray_nodes = None


def make_groups(seed: int = 0, count: int = 5, size: int = 4) -> list[Group]:
    """Groups of varied lengths sharing a prompt each, mixed rewards, behaviour log-probs."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [1] + [rng.randrange(4, 30) for _ in range(rng.randrange(3, 9))]
        trajectories = []
        for i in range(size):
            completion = [rng.randrange(4, 30) for _ in range(rng.randrange(1, 7))]
            ids = tuple(prompt + completion)
            trajectories.append(Trajectory(
                prompt_id=g, sample_index=i, token_ids=ids,
                loss_mask=tuple([False] * len(prompt) + [True] * len(completion)),
                logprobs=tuple(-3.0 - rng.random() for _ in ids), versions=(0,) * len(ids),
                reward=float(rng.random() < 0.5), start_version=0,
                finish_reason=FinishReason.STOP))
        groups.append(Group(g, tuple(trajectories), 0))
    return groups


def docker_available() -> bool:
    """A Docker engine answers here and holds the sandbox image (scripts/docker_setup.sh)."""
    from sandboxes.api import EngineUnavailable
    from sandboxes.docker import DockerSandboxConfig
    from sandboxes.docker.engine import connect

    try:
        client = connect()
    except EngineUnavailable:
        return False
    try:
        return any(DockerSandboxConfig().image in i.tags for i in client.images.list())
    finally:
        client.close()
