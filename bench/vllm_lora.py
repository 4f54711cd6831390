"""What a LoRA update costs the vLLM engine: merged weights (what ``engine=vllm`` does) against
full weights and against vLLM's own LoRA support (``enable_lora``, a ``LoRARequest`` per
update). Run in ``.venv-vllm``: ``.venv-vllm/bin/python -m bench.vllm_lora [--model smollm2]``.

Updates (each the median of ``--repeats``, through ``sync_weights``: pause, load, resume):

* ``full``: the model's full weights as one update (safetensors bytes, as an in-process
  trainer's update travels to the engine's workers).
* ``merged``: an adapter-only update of a LoRA trainer (``r=8``, ``alpha=16``, the attention
  projections, lora_B random so the merge is not trivial): the engine computes
  ``W0 + scale * B @ A`` for each adapted weight and vLLM reloads those (``AdapterMerger``).
* ``vllm_lora``: the same adapters as vLLM takes them: written as a PEFT directory
  (``save_pretrained``), loaded with ``add_lora`` under a new id, the previous one removed.

Generation: ``REQUESTS`` concurrent requests of ``TOKENS`` tokens each (random prompts of 16
ids, temperature 1), tokens per second of wall time, on the engine with merged weights and on an
``enable_lora`` engine with each request under the adapter (``LoRARequest``) and without it.
Both engines run eager (``enforce_eager``: vLLM's CPU build turns compilation off when LoRA is
enabled, so the merged engine is measured the same way; compiled, it would only be faster).

Sizes: ``--model tiny`` (the default: hidden 128, 4 layers) or ``smollm2``, ``--repeats`` 5.
``--smoke`` (the tests'; most of its time is the two engines' start): the tiny model cut to 2
layers (vLLM's CPU attention wants a head size of 32, so not the toy model), 2 repeats; it
checks the bench runs end to end, its figures say nothing. Without vLLM (``.venv``) the bench
says so in one line and exits with status 3.

Last line: ``lora_merged_vs_full=<full update seconds / merged update seconds>``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.cli import add_smoke, headline, refuse
from orchestrator.algo.grpo import GRPO
from orchestrator.engines.base import sync_weights
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import build_policy
from orchestrator.trainer import TorchTrainer
from orchestrator.weights.update import WeightUpdate

MODELS = {
    "tiny": {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 128,
             "num_layers": 4, "num_heads": 4, "intermediate_size": 512,
             "max_position_embeddings": 256, "dtype": "float32", "device": "cpu", "seed": 0},
    "smollm2": {"_target_": "orchestrator.models.policy.pretrained_policy", "gguf": "smollm2",
                "dtype": "float32", "device": "cpu"},
}
MODELS["smoke"] = {**MODELS["tiny"], "num_layers": 2}
SMOKE_REPEATS = 2
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
ENGINE = {"kv_cache_bytes": "512MiB", "max_num_seqs": 32, "enforce_eager": True,
          "max_model_len": 256}
REQUESTS, TOKENS = 16, 64


def lora_trainer(model: dict[str, Any]) -> TorchTrainer:
    trainer = TorchTrainer(build_policy(model), GRPO(), lora=LORA)
    torch.manual_seed(1)
    with torch.no_grad():  # as after some training: B is zero at the start
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn_like(p) * 0.01)
    return trainer


async def median_seconds(repeats: int, once: Callable[[int], Awaitable[None]]) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        await once(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def tokens_per_s(llm: Any, vocab: int, lora: Any = None) -> float:
    from vllm import SamplingParams as VLLMSampling

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(REQUESTS)]
    sampling = VLLMSampling(max_tokens=TOKENS, temperature=1.0, ignore_eos=True, seed=0,
                            detokenize=False)

    async def one(prompt: list[int]) -> int:
        async for out in llm.generate({"prompt_token_ids": prompt}, sampling,
                                      request_id=uuid.uuid4().hex, lora_request=lora):
            final = out
        return len(final.outputs[0].token_ids)

    await one(prompts[0])  # warm up
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


async def merged_engine(model: dict[str, Any], trainer: TorchTrainer, first: WeightUpdate,
                        repeats: int) -> dict[str, float]:
    full = {k: v for k, v in first.tensors().items() if "::" not in k}
    async with VLLMEngine(model, first, **ENGINE) as engine:
        vocab = engine._llm.model_config.get_vocab_size()

        async def full_update(i: int) -> None:
            await sync_weights(engine, WeightUpdate.by_reference(2 * repeats + i + 1, full,
                                                                 leased=False))

        async def adapter_update(i: int) -> None:
            update = await trainer.weights()
            await sync_weights(engine, WeightUpdate.by_reference(
                i + 1, update.tensors(), leased=False).with_adapters(update.adapters))

        out = {"merged_s": await median_seconds(repeats, adapter_update)}
        update = await trainer.weights()

        async def merge_only(i: int) -> None:
            engine._adapters.merged(update)

        out["merge_only_s"] = await median_seconds(repeats, merge_only)
        # last: a full update drops the base weights adapter updates are merged onto
        out["full_s"] = await median_seconds(repeats, full_update)
        out["full_bytes"] = float(sum(t.nbytes for t in full.values()))
        out["adapter_bytes"] = float((await trainer.weights()).nbytes)
        out["merged_tokens_per_s"] = await tokens_per_s(engine._llm, vocab)
    return out


async def lora_engine(model: dict[str, Any], trainer: TorchTrainer, first: WeightUpdate,
                      repeats: int) -> dict[str, float]:
    from vllm.lora.request import LoRARequest

    base = {k: v for k, v in first.tensors().items() if "::" not in k}
    engine = VLLMEngine(model, WeightUpdate.by_reference(0, base, leased=False), **ENGINE)
    engine._options.update(enable_lora=True, max_lora_rank=LORA["r"], max_loras=1)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with engine:
            llm = engine._llm
            vocab = llm.model_config.get_vocab_size()
            current: list[LoRARequest] = []

            async def add(i: int) -> None:
                path = Path(tmp) / f"adapter{i}"
                trainer.model.save_pretrained(path)  # what a trainer would send: its adapters
                request = LoRARequest(f"step{i}", i + 1, str(path))
                await llm.add_lora(request)
                if current:
                    await llm.remove_lora(current.pop().lora_int_id)
                current.append(request)

            out["vllm_lora_s"] = await median_seconds(repeats, add)
            out["lora_tokens_per_s"] = await tokens_per_s(llm, vocab, current[0])
            out["lora_engine_base_tokens_per_s"] = await tokens_per_s(llm, vocab)
    return out


async def measure(model_name: str, repeats: int) -> None:
    model = MODELS[model_name]
    trainer = lora_trainer(model)
    first = await trainer.weights()  # the base weights and the adapters
    merged = await merged_engine(model, trainer, first, repeats)
    native = await lora_engine(model, trainer, first, repeats)
    print(f"model={model_name} r={LORA['r']} targets={','.join(LORA['target_modules'])} "
          f"repeats={repeats}")
    print(f"update full:      {merged['full_s'] * 1e3:8.1f} ms  ({merged['full_bytes'] / 1e6:.2f} MB)")
    print(f"update merged:    {merged['merged_s'] * 1e3:8.1f} ms  "
          f"({merged['adapter_bytes'] / 1e6:.3f} MB of adapters; the merge "
          f"{merged['merge_only_s'] * 1e3:.1f} ms of it)")
    print(f"update vllm_lora: {native['vllm_lora_s'] * 1e3:8.1f} ms  (PEFT directory + add_lora)")
    print(f"generate merged weights:          {merged['merged_tokens_per_s']:8.1f} tokens/s")
    print(f"generate vllm_lora (LoRARequest): {native['lora_tokens_per_s']:8.1f} tokens/s")
    print(f"generate enable_lora, no adapter: {native['lora_engine_base_tokens_per_s']:8.1f} tokens/s")
    headline("lora_merged_vs_full", merged["full_s"] / merged["merged_s"], 2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="tiny (the default), smollm2 (--smoke: smoke, tiny with 2 layers)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"updates a figure is the median of (5; --smoke {SMOKE_REPEATS})")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        refuse("vllm_lora", "vLLM is not installed here: run it with .venv-vllm/bin/python "
                            "(bash scripts/setup_vllm.sh)")
    model = args.model or ("smoke" if args.smoke else "tiny")
    asyncio.run(measure(model, args.repeats or (SMOKE_REPEATS if args.smoke else 5)))


if __name__ == "__main__":
    main()
