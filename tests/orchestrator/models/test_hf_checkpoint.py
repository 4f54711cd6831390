"""A local Hugging Face checkpoint (model + tokenizer + chat template) trains through the
same ``model`` config group: ``model=hf model.path=<dir>``. The checkpoint is built here,
offline: a tiny Qwen2 model and a byte-level BPE tokenizer trained on a few lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import build_hf_checkpoint
from hydra import compose, initialize_config_dir

from orchestrator.builders import run
from orchestrator.models.policy import pretrained_policy

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("hf-checkpoint"))


def test_the_tokenizer_keeps_its_chat_template_and_appends_turns(checkpoint: Path) -> None:
    policy = pretrained_policy(str(checkpoint), dtype="float32", device="cpu")
    tok = policy.tokenizer
    prompt = tok.chat_prompt([{"role": "user", "content": "07+85="}])
    assert tok.decode(prompt).endswith("assistant\n")
    follow = tok.chat_prompt([{"role": "user", "content": "again"}], continuation=True)
    assert "again" in tok.decode(follow) and follow != prompt
    assert tok.stop_ids[0] == tok._tok.convert_tokens_to_ids("<|im_end|>")


def test_a_local_checkpoint_trains_through_the_model_group(checkpoint: Path, tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "experiment=smoke", "model=hf", f"model.path={checkpoint}", "model.dtype=float32",
            "model.device=cpu", "logger=none", "progress=false",
        ])
    result = run(cfg, tmp_path)
    assert len(result.reports) == cfg.pipeline.num_steps
    assert all(r.tokens > 0 for r in result.reports)
    saved = tmp_path / "checkpoints" / "final" / "model"
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer.json").is_file()
    assert pretrained_policy(str(saved), dtype="float32", device="cpu").tokenizer.vocab_size == \
        pretrained_policy(str(checkpoint), dtype="float32", device="cpu").tokenizer.vocab_size
