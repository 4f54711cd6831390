"""``python -m orchestrator.export``'s directory served by vLLM (the CPU build in .venv-vllm):
vLLM loads the weights, config and tokenizer, renders the chat template as the run does, and
its greedy continuations are those of ``transformers`` on the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import quick_config

from orchestrator.engines.vllm_engine import _close_zmq
from orchestrator.export import export
from orchestrator.main import run
from orchestrator.models.tokenizer import CharTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # about 17 s: a vLLM engine's start; slow files start first (tests/conftest.py: schedule)
    # vLLM and the torch internals it loads warn about their own deprecations on import
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TOK = CharTokenizer()
PROMPTS = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in ((12, 34), (7, 58), (90, 9))]


def test_vllm_serves_the_export_as_transformers_does(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    # head size 32: vLLM's CPU attention rejects 16
    run(quick_config("smoke", "model.hidden_size=64", "model.num_heads=2", "checkpoint.every=1",
                     "warmstart.steps=12", "warmstart.lr=3e-3"), tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(out).eval()
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, max_model_len=128)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
                   for m in PROMPTS]
        assert [list(p) for p in prompts] == [TOK.chat_prompt(m) for m in PROMPTS]
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8))
        for ids, output in zip(prompts, outputs, strict=True):
            expected = reference.generate(torch.tensor([list(ids)]), max_new_tokens=8, do_sample=False,
                                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            assert list(output.outputs[0].token_ids) == expected[0, len(ids):].tolist()
    finally:
        llm.llm_engine.engine_core.shutdown()  # its engine process, before the interpreter ends
        _close_zmq(llm.llm_engine)  # and its ZMQ context, which warns when collected
