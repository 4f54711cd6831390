"""A local Hugging Face checkpoint (model + tokenizer + chat template) trains through the
same ``model`` config group: ``model=hf model.path=<dir>``. The checkpoint is built here,
offline: a tiny Qwen2 model and a byte-level BPE tokenizer trained on a few lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.main import run
from orchestrator.models.policy import pretrained_policy

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    path = tmp_path_factory.mktemp("hf-checkpoint")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"{a:02d}+{b:02d}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 9)]
    bpe.train_from_iterator(corpus + ["user assistant system"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


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
