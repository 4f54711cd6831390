"""Tokenizers and the chat format.

The default policy is tiny and trained from scratch, so it gets a character-level tokenizer
of its own: every printable ASCII character is one token, plus a handful of special tokens
that frame chat turns. A local Hugging Face checkpoint brings its own tokenizer and chat
template through :class:`HFTokenizer`; both satisfy :class:`Tokenizer`.

Chat layout of :class:`CharTokenizer` (one token per special)::

    <bos><user>37+85=<end><assistant>122<end>

A prompt ends with ``<assistant>``; generation stops at ``<end>``.

Tools: ``chat_prompt(..., tools=schemas)`` takes OpenAI function-tool schemas. A chat
template that renders tools itself (its source uses ``tools``) gets them natively; otherwise
they are described in the system message, with the project's Hermes format
(``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, :data:`tool_format`) that the
episode's parser reads.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.base import Message
from orchestrator.errors import ConfigError

ToolSchema = Mapping[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
TOOLS_PREAMBLE = ("You can call tools. To call one, write <tool_call>{\"name\": <tool name>, "
                  "\"arguments\": <a JSON object>}</tool_call>; the result comes back as a tool "
                  "message. Tools:")


def describe_tools(messages: Sequence[Message], tools: Sequence[ToolSchema]) -> list[Message]:
    """``messages`` with ``tools`` described in the system message (one is added first when
    there is none), for a chat format that has no tool support of its own."""
    text = "\n".join([TOOLS_PREAMBLE, *(json.dumps(t, sort_keys=True) for t in tools)])
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        return messages
    return [{"role": "system", "content": text}, *messages]


class Tokenizer(ABC):
    pad_id: int
    vocab_size: int
    tool_format: str = "hermes"  # the envs.parsers format this model's tool calls are read with

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def chat_prompt(self, messages: Sequence[Message], continuation: bool = False,
                    tools: Sequence[ToolSchema] | None = None) -> list[int]:
        """Token ids of ``messages`` followed by the header of the assistant's turn.

        With ``continuation`` the ids are meant to be appended after an assistant turn that
        ended with a stop token (no beginning-of-sequence marker). ``tools`` (OpenAI
        function schemas) are offered to the model as its chat format allows.
        """

    @property
    @abstractmethod
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn."""

    def render(self, ids: Sequence[int]) -> str:
        """``ids`` as text with the special tokens written out (a chat prompt as the model
        sees it); :meth:`decode` drops them."""
        return self.decode(ids)

    def completion(self, text: str) -> list[int]:
        """Token ids of an assistant reply, stop token included (for supervised targets)."""
        return self.encode(text) + [self.stop_ids[0]]

    def save_pretrained(self, directory: Path) -> None:
        """Write this tokenizer's files beside a checkpoint's model (a built-in tokenizer has
        none: the model config names it)."""


class CharTokenizer(Tokenizer):
    SPECIALS = ("<pad>", "<bos>", "<end>", "<system>", "<user>", "<assistant>", "<tool>")
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self._itos = list(self.SPECIALS) + list(self.CHARS)
        self._stoi = {s: i for i, s in enumerate(self._itos)}
        self.vocab_size = len(self._itos)
        self.pad_id = self._stoi["<pad>"]
        self.bos_id = self._stoi["<bos>"]
        self.end_id = self._stoi["<end>"]
        self._unknown = self._stoi["?"]

    def encode(self, text: str) -> list[int]:
        return [self._stoi.get(ch, self._unknown) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(
            self._itos[i] for i in ids if 0 <= i < self.vocab_size and i >= len(self.SPECIALS)
        )

    def render(self, ids: Sequence[int]) -> str:
        return "".join(self._itos[i] for i in ids if 0 <= i < self.vocab_size)

    def chat_prompt(self, messages: Sequence[Message], continuation: bool = False,
                    tools: Sequence[ToolSchema] | None = None) -> list[int]:
        if tools:
            messages = describe_tools(messages, tools)
        ids = [] if continuation else [self.bos_id]
        for message in messages:
            role = message["role"]
            if f"<{role}>" not in self._stoi:
                raise ValueError(f"unknown chat role {role!r}")
            ids += [self._stoi[f"<{role}>"], *self.encode(message["content"]), self.end_id]
        return ids + [self._stoi["<assistant>"]]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.end_id,)

    def to_hf(self) -> Any:
        """This tokenizer as a ``transformers`` fast tokenizer (a ``tokenizers`` word-level
        model over single characters): the same ids for the same text, the same chat layout
        from its chat template (tools are described in the system message, as here, by
        :class:`HFTokenizer`), ``<end>`` as its end of sequence. What
        ``orchestrator.commands.export`` writes beside a tiny model, so ``AutoTokenizer`` and
        ``model=hf`` load it. One difference: a special's name in text (``"<user>"``) is that
        special there, its characters here."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend
        from transformers import PreTrainedTokenizerFast

        # "?" stands for a character out of the vocabulary, as in encode(); it stays an
        # ordinary token (not the unknown special, which decoding would drop)
        backend = Backend(models.WordLevel(dict(self._stoi), unk_token="?"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        roles = [s[1:-1] for s in self.SPECIALS[3:]]
        template = (
            "{{ bos_token }}{% for m in messages %}"
            f"{{% if m['role'] not in {roles} %}}"
            "{{ raise_exception('unknown chat role ' + m['role']) }}{% endif %}"
            "<{{ m['role'] }}>{{ m['content'] }}<end>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<bos>", eos_token="<end>", pad_token="<pad>",
            additional_special_tokens=list(self.SPECIALS[3:]), chat_template=template)


class HFTokenizer(Tokenizer):
    """A local Hugging Face tokenizer and its chat template (no network access)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except OSError as e:
            raise ConfigError(f"model.path={path} holds no loadable tokenizer: {e}") from e
        self.vocab_size = len(self._tok)
        pad = self._tok.pad_token_id
        self.pad_id = pad if pad is not None else self._tok.eos_token_id
        stops = [self._tok.eos_token_id]
        for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = self._tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self._tok.unk_token_id and tid not in stops:
                stops.append(tid)
        self._stops = tuple(s for s in stops if s is not None)

    def save_pretrained(self, directory: Path) -> None:
        self._tok.save_pretrained(str(directory))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def native_tools(self) -> bool:
        """Whether the chat template renders tool schemas itself."""
        template = self._tok.chat_template
        return isinstance(template, str) and "tools" in template

    def chat_prompt(self, messages: Sequence[Message], continuation: bool = False,
                    tools: Sequence[ToolSchema] | None = None) -> list[int]:
        if tools and not self.native_tools:
            messages, tools = describe_tools(messages, tools), None
        if self._tok.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
            return self.encode(text)
        if not continuation:
            return self._template(list(messages), tools=tools)
        # The template renders whole conversations; the ids of the new messages are what a
        # fixed conversation gains when they are appended to it.
        # They start right after the assistant turn's stop token (the last token the engine
        # sampled), so what the template puts after it (ChatML's newline) is theirs.
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self._template(base, generation_prompt=False)
        ends = [i for i, t in enumerate(before) if t in self._stops]
        if ends:
            before = before[: ends[-1] + 1]
        after = self._template(base + list(messages))
        if after[: len(before)] != before:
            raise ValueError("this chat template does not render appended messages as a suffix")
        return after[len(before) :]

    def _template(self, messages: list[Message], generation_prompt: bool = True,
                  tools: Sequence[ToolSchema] | None = None) -> list[int]:
        ids = self._tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False,
            tools=list(tools) if tools else None,
        )
        return list(ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stops
