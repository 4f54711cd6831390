"""``engine=vllm``'s options are checked before vLLM is touched, each with one line naming the
key; without vLLM installed, the engine says how to install it (runs in .venv, no vLLM)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import TINY_MODEL, quick_config

from orchestrator.engines.vllm_engine import VLLMEngine, parse_bytes
from orchestrator.errors import ConfigError
from orchestrator.weights.update import Adapters, WeightUpdate


@pytest.mark.parametrize(("option", "message"), [
    ({"gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization=1.5 must be in (0, 1]"),
    ({"gpu_memory_utilization": 0}, "engine.gpu_memory_utilization=0 must be in (0, 1]"),
    ({"max_num_seqs": 0}, "engine.max_num_seqs must be >= 1"),
    ({"max_model_len": 1}, "engine.max_model_len must be >= 2 or null"),
    ({"tensor_parallel_size": 0}, "engine.tensor_parallel_size must be >= 1"),
    ({"dtype": "float8"}, "engine.dtype=float8 is not one of auto, float32, bfloat16, float16"),
    ({"kv_cache_bytes": "lots"}, "engine.kv_cache_bytes=lots must be a positive size"),
    ({"kv_cache_bytes": 0}, "engine.kv_cache_bytes=0 must be a positive size"),
    ({"kv_cache_bytes": "12XB"}, "engine.kv_cache_bytes=12XB must be a positive size"),
])
def test_a_bad_option_is_named_in_one_line(option: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        VLLMEngine(TINY_MODEL, **option)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_attestation_is_refused_where_vllm_cannot_fingerprint_what_the_trainer_publishes() -> None:
    lora = WeightUpdate.by_reference(0, {"q::lora_A": torch.zeros(2, 2)}, leased=False)
    cases = [({"tensor_parallel_size": 2}, "engine.tensor_parallel_size=2 shards them"),
             ({"weights": lora.with_adapters(Adapters(scale=1.0, modules=("q",)))},
              "set engine.attest=false with trainer.lora")]
    for option, message in cases:
        with pytest.raises(ConfigError) as error:
            VLLMEngine(TINY_MODEL, attest=True, **option)
        assert message in str(error.value) and "\n" not in str(error.value)
        assert "engine.attest=false" in str(error.value)


def test_the_config_group_composes_with_every_option() -> None:
    engine = quick_config("smoke", "engine=vllm").engine
    assert engine._target_ == "orchestrator.engines.vllm_engine.VLLMEngine"
    for key in ("gpu_memory_utilization", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                "dtype", "enable_prefix_caching", "kv_cache_bytes"):
        assert key in engine, key


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_error_says_how_to_install_it() -> None:
    with pytest.raises(ConfigError, match=r"engine=vllm needs vLLM: pip install -e '\.\[vllm\]'"):
        VLLMEngine(TINY_MODEL)


@pytest.mark.parametrize(("value", "expected"), [
    (1 << 20, 1 << 20), ("512MiB", 512 << 20), ("1GiB", 1 << 30), ("2 GiB", 2 << 30),
    ("1.5GiB", 3 << 29), ("100MB", 10**8), ("auto", None), (None, None),
])
def test_kv_cache_sizes_are_read_in_bytes(value: object, expected: int | None) -> None:
    assert parse_bytes(value) == expected  # type: ignore[arg-type]


def test_an_fp32_head_on_the_trainer_side_only_is_refused() -> None:
    with pytest.raises(ConfigError, match="^model.fp32_head=true is for engine=torch"):
        VLLMEngine({**TINY_MODEL, "fp32_head": True})
