"""The character tokenizer and its chat layout (orchestrator/models/tokenizer.py)."""

from __future__ import annotations

import pytest

from orchestrator.models.tokenizer import CharTokenizer


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer()


def special(tok: CharTokenizer, name: str) -> int:
    return CharTokenizer.SPECIALS.index(f"<{name}>")


@pytest.mark.parametrize("text", ["37+85=", "hello, world!\n", "", "~{}|`" + "".join(map(chr, range(32, 127)))])
def test_round_trip(tok: CharTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(i >= len(CharTokenizer.SPECIALS) for i in ids)
    assert tok.decode(ids) == text


def test_unknown_characters_become_question_marks(tok: CharTokenizer) -> None:
    assert tok.decode(tok.encode("a\u00e9b")) == "a?b"


def test_decode_drops_specials_and_out_of_range_ids(tok: CharTokenizer) -> None:
    ids = [tok.bos_id, *tok.encode("12"), tok.end_id, tok.pad_id, tok.vocab_size, -1]
    assert tok.decode(ids) == "12"


def test_vocabulary(tok: CharTokenizer) -> None:
    assert tok.vocab_size == len(CharTokenizer.SPECIALS) + 96
    assert tok.pad_id == 0 and tok.stop_ids == (tok.end_id,)
    assert len({tok.pad_id, tok.bos_id, tok.end_id}) == 3


def test_chat_prompt_layout(tok: CharTokenizer) -> None:
    ids = tok.chat_prompt([{"role": "user", "content": "37+85="}])
    assert ids == [tok.bos_id, special(tok, "user"), *tok.encode("37+85="), tok.end_id,
                   special(tok, "assistant")]


def test_chat_prompt_with_several_messages(tok: CharTokenizer) -> None:
    ids = tok.chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert ids == [tok.bos_id, special(tok, "system"), *tok.encode("s"), tok.end_id,
                   special(tok, "user"), *tok.encode("u"), tok.end_id, special(tok, "assistant")]


def test_continuation_has_no_bos(tok: CharTokenizer) -> None:
    ids = tok.chat_prompt([{"role": "tool", "content": "42"}], continuation=True)
    assert ids == [special(tok, "tool"), *tok.encode("42"), tok.end_id, special(tok, "assistant")]
    assert tok.bos_id not in ids


def test_unknown_role_is_refused(tok: CharTokenizer) -> None:
    with pytest.raises(ValueError, match="robot"):
        tok.chat_prompt([{"role": "robot", "content": "x"}])


def test_completion_ends_with_the_stop_token(tok: CharTokenizer) -> None:
    assert tok.completion("122") == [*tok.encode("122"), tok.end_id]
