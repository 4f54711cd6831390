"""vLLM (the CPU build in .venv-vllm) on what a run leaves: ``python -m orchestrator.eval …
engine=vllm``, as a user runs it, on a run's checkpoint (its weights loaded into vLLM) and on
its export (served as it is on disk) gives the greedy completions and figures the torch engine
gives; and ``python -m orchestrator.export``'s directory, loaded by vLLM itself, renders the chat
template as the run does and continues greedily as ``transformers`` does on it. One run and its
export serve the module."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import REPO, quick_config

from orchestrator.builders import run
from orchestrator.commands.eval import evaluate_target
from orchestrator.commands.export import export
from orchestrator.engines.vllm_engine import _close_zmq
from orchestrator.models.tokenizer import CharTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # about 70 s: three vLLM engines' starts; slow files start first (tests/conftest.py: schedule)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VLLM = ["engine=vllm", "engine.kv_cache_bytes=256MiB", "engine.enforce_eager=true",
        "progress=false"]


def completions(path: Path) -> list[tuple[int, str]]:
    return [(e["task_id"], e["completion"]) for e in json.loads(path.read_text())["examples"]]


def evaluate_with_vllm(target: Path, out: Path, *overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    done = forked.run([sys.executable, "-m", "orchestrator.eval", str(target), *VLLM,
                       *overrides, "-o", str(out)], cwd=REPO, env=env, capture_output=True,
                      text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A short run (a warm start that makes its greedy answers differ from a random model's),
    then its export: the run directory and the export's."""
    root = tmp_path_factory.mktemp("run")
    # head size 32: vLLM's CPU attention rejects 16
    run(quick_config("smoke", "model.hidden_size=64", "model.num_heads=2", "checkpoint.every=1",
                     "warmstart.steps=12", "warmstart.lr=3e-3"), root / "run")
    return root / "run", export(root / "run", root / "hf")


def test_engine_vllm_evaluates_a_checkpoint_and_an_export_as_the_torch_engine(
        exported: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir, hf = exported
    torch_engine, _ = evaluate_target(run_dir, out=tmp_path / "torch.json")
    assert any(c.strip() for _, c in completions(tmp_path / "torch.json"))

    line = evaluate_with_vllm(run_dir, tmp_path / "vllm.json")
    assert line == f"eval_mean={torch_engine.evaluation.mean:.4f} " \
                   f"pass_at_1={torch_engine.evaluation.overall.pass_at[1]:.4f}"
    assert completions(tmp_path / "vllm.json") == completions(tmp_path / "torch.json")

    evaluate_with_vllm(hf, tmp_path / "hf.json", "experiment=smoke", "model.dtype=float32",
                       "env.train_size=32", "env.eval_size=4", "eval.num_tasks=4")
    assert completions(tmp_path / "hf.json") == completions(tmp_path / "torch.json")


TOK = CharTokenizer()
PROMPTS = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in ((12, 34), (7, 58), (90, 9))]


def test_vllm_serves_the_export_as_transformers_does(exported: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    _, out = exported
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
