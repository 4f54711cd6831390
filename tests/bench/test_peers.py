"""bench.peers' shared pieces (in bench.peers_trl): the character tokenizer wrapped for
Hugging Face (TRL's ``processing_class``) renders token-identical prompts, and the warm
policy loads its weights."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from helpers import TINY_MODEL

from bench.peers_trl import arithmetic_spec, char_tokenizer_fast, warm_policy
from orchestrator.models.policy import tiny_policy
from orchestrator.models.tokenizer import CharTokenizer, HFTokenizer


def test_prompts_are_token_identical_to_the_char_tokenizer() -> None:
    fast, char = char_tokenizer_fast(), CharTokenizer()
    spec = arithmetic_spec()
    tasks = [*spec.tasks("train")[:50], *spec.tasks("eval")[:50]]
    conversations = [list(t.messages) for t in tasks] + [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b\nc"}]]
    for messages in conversations:
        ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        assert list(ids) == char.chat_prompt(messages)
    # TRL tokenises the whole batch in one call
    batch = fast.apply_chat_template([list(t.messages) for t in tasks], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    assert [list(ids) for ids in batch] == [char.chat_prompt(t.messages) for t in tasks]


def test_ids_specials_and_decoding_match() -> None:
    fast, char = char_tokenizer_fast(), CharTokenizer()
    text = "".join(CharTokenizer.CHARS) + "\u00e9"  # every character, and an unknown one
    assert fast.encode(text, add_special_tokens=False) == char.encode(text)
    assert len(fast) == char.vocab_size
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == \
        (char.pad_id, char.bos_id, char.end_id)
    reply = [*char.encode("122"), char.end_id, char.pad_id]
    assert fast.decode(reply, skip_special_tokens=True) == char.decode(reply) == "122"


def test_saved_tokenizer_loads_as_the_projects_hf_tokenizer(tmp_path: Path) -> None:
    char_tokenizer_fast().save_pretrained(tmp_path)
    loaded, char = HFTokenizer(tmp_path), CharTokenizer()
    messages = [{"role": "user", "content": "07+85="}]
    assert loaded.chat_prompt(messages) == char.chat_prompt(messages)
    assert loaded.stop_ids == char.stop_ids and loaded.pad_id == char.pad_id


def test_warm_policy_loads_saved_weights(tmp_path: Path) -> None:
    tiny = {k: v for k, v in TINY_MODEL.items() if k != "_target_"}
    source = tiny_policy(**tiny, seed=1).model
    source.save_pretrained(tmp_path)
    loaded = warm_policy(str(tmp_path / "model.safetensors"), **tiny, seed=2).model
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert a.equal(b), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
