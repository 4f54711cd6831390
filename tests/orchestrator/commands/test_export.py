"""``python -m orchestrator.export``: checkpoints as runs write them (a run in one process;
LoRA on two trainer ranks and in one process) out as Hugging Face directories that
``transformers`` and ``model=hf`` load, computing what the checkpoint's own trainer computes;
bad input in one line."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import forked
import pytest
import torch
from helpers import REPO, make_groups, quick_config
from omegaconf import OmegaConf
from safetensors.torch import load_file

from orchestrator.builders import run
from orchestrator.commands.export import export, locate, main
from orchestrator.config.read import section
from orchestrator.launch import TrainerRecipe
from orchestrator.launch.ranks import process_group
from orchestrator.models.policy import build_policy
from orchestrator.models.tokenizer import CharTokenizer, HFTokenizer
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.trainer import TorchTrainer

TOK = CharTokenizer()
CHECKPOINTS = ("checkpoint.every=1", "checkpoint.keep=3")
# enough warm start for the tiny model to answer in digits and stop (two steps: it repeats a
# special token), so the greedy continuations compared say something
WARM = ("warmstart.steps=12", "warmstart.lr=3e-3")
LORA = ("trainer.lora.r=4", "trainer.lora.alpha=8")
PROMPTS = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in ((12, 34), (7, 58), (90, 9))]
PROMPTS.append([{"role": "system", "content": "add"}, {"role": "user", "content": "5+5="}])


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two RL steps in one process: a checkpoint before and after each, and a final
    one."""
    run_dir = tmp_path_factory.mktemp("plain")
    run(quick_config("smoke", *CHECKPOINTS, *WARM), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two run directories of one LoRA config, each with a checkpoint written by the run's
    checkpoint store after the same warm-start step and RL step: one by two trainer ranks
    (shards), one by the trainer in this process.

    Not two runs of ``orchestrator.builders``: their rollouts differ from run to run, and on
    ranks a warm-start step after the engines' first weights changes nothing (so a tiny run's
    weights would stay at their initialisation)."""
    cfg = quick_config("smoke", *LORA, "trainer.world_size=2")
    recipe = TrainerRecipe(trainer=section(cfg, "trainer"), model=section(cfg, "model"),
                           algo=section(cfg, "algo"), torch_threads=1)
    sequences = [list(t.token_ids) for g in make_groups(seed=3) for t in g.trajectories]
    masks = [[True] * len(s) for s in sequences]
    ranks, one = tmp_path_factory.mktemp("ranks"), tmp_path_factory.mktemp("one")
    for run_dir, world_size in ((ranks, 2), (one, None)):
        OmegaConf.update(cfg, "trainer.world_size", world_size)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        trainer = (process_group(recipe, 2) if world_size else
                   replace(recipe, trainer={**recipe.trainer, "world_size": None}).build())
        try:
            anyio.run(trainer.supervised_step, sequences, masks, 1e-3)
            anyio.run(trainer.step, make_groups())
            snapshot = trainer.snapshot()
            CheckpointStore(run_dir / "checkpoints").save(1, snapshot.write)
        finally:
            anyio.run(trainer.aclose)
    return ranks, one


def restored(run_dir: Path, checkpoint: Path) -> TorchTrainer:
    """The trainer the run's config builds, in this process, loaded from ``checkpoint``."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    section = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("trainer", "model", "algo")}
    trainer = TrainerRecipe(trainer={**section["trainer"], "world_size": None},  # type: ignore[dict-item]
                            model={**section["model"], "device": "cpu"},  # type: ignore[dict-item]
                            algo=section["algo"]).build()  # type: ignore[arg-type]
    assert isinstance(trainer, TorchTrainer)
    trainer.load(checkpoint)
    trainer.model.eval()
    return trainer


def greedy(model: torch.nn.Module, prompt: list[int], steps: int = 10) -> list[int]:
    """Argmax continuation of ``prompt``, whole-sequence forwards, up to the stop token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == TOK.end_id:
                break
    return ids[len(prompt):]


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def check_export(out: Path, trainer: TorchTrainer) -> Any:
    """``transformers`` loads ``out``: its tokenizer gives the run's prompt ids, and its
    greedy ``generate`` the continuation the restored trainer's model gives; the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for messages in PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert list(ids) == TOK.chat_prompt(messages)
        expected = greedy(trainer.model, list(ids))
        out_ids = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=10, do_sample=False)
        assert out_ids[0, len(ids):].tolist() == expected, messages
        torch.testing.assert_close(logits(model, list(ids)), logits(trainer.model, list(ids)),
                                   atol=1e-5, rtol=0)
    return model


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def test_transformers_loads_the_export_and_continues_as_the_checkpoint(plain: Path,
                                                                      tmp_path: Path) -> None:
    out = export(plain, tmp_path / "hf")
    trainer = restored(plain, plain / "checkpoints" / "final")
    check_export(out, trainer)
    saved = weights(out)
    assert "lm_head.weight" not in saved  # tied: once, and tied again on loading
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    for name, tensor in trainer.model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(saved[name], tensor), name
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == TOK.end_id
    assert (out / "chat_template.jinja").is_file() and not list(tmp_path.glob(".*"))

    # --step: that checkpoint's weights, not the latest
    earlier = export(plain, tmp_path / "step-1", step=1)
    checkpoint = load_file(str(plain / "checkpoints" / "step-1" / "model" / "model.safetensors"))
    assert weights(earlier).keys() == checkpoint.keys()
    assert all(torch.equal(weights(earlier)[k], v) for k, v in checkpoint.items())
    assert locate(plain, step=1).path == plain / "checkpoints" / "step-1"
    # a checkpoint directory of the run
    again = export(plain / "checkpoints" / "step-1", tmp_path / "again")
    assert all(torch.equal(weights(again)[k], v) for k, v in checkpoint.items())


def test_model_hf_builds_a_policy_from_the_export(plain: Path, tmp_path: Path) -> None:
    out = export(plain, tmp_path / "hf")
    policy = build_policy({"_target_": "orchestrator.models.policy.pretrained_policy",
                           "path": str(out), "dtype": "float32", "device": "cpu"})
    trainer = restored(plain, plain / "checkpoints" / "final")
    assert isinstance(policy.tokenizer, HFTokenizer)
    assert policy.tokenizer.vocab_size == TOK.vocab_size and policy.tokenizer.stop_ids == TOK.stop_ids
    for messages in PROMPTS:
        ids = policy.tokenizer.chat_prompt(messages)
        assert ids == TOK.chat_prompt(messages)
        assert greedy(policy.model, ids) == greedy(trainer.model, ids)
    tool = [{"role": "tool", "content": "42"}]
    assert policy.tokenizer.chat_prompt(tool, continuation=True) == TOK.chat_prompt(tool, continuation=True)
    text = "37+85=122 ?\n"
    assert policy.tokenizer.decode(policy.tokenizer.encode(text)) == text


def test_a_sharded_lora_checkpoint_exports_the_weights_of_one_process(
        lora_runs: tuple[Path, Path], tmp_path: Path) -> None:
    ranks, one = lora_runs
    assert (ranks / "checkpoints" / "step-1" / "shards").is_dir()
    assert (one / "checkpoints" / "step-1" / "model" / "model.safetensors").is_file()
    sharded = export(ranks, tmp_path / "from-ranks")
    single = export(one, tmp_path / "from-one")
    a, b = weights(sharded), weights(single)
    assert a.keys() == b.keys() and not any("lora" in k for k in a)
    for name, tensor in b.items():  # the ranks sum their shares in another order: rounding
        torch.testing.assert_close(a[name], tensor, atol=1e-5, rtol=0)

    # merged: W0 + alpha / r * B A, from the one-process checkpoint's own tensors
    saved = load_file(str(one / "checkpoints" / "step-1" / "model" / "model.safetensors"))
    scale = 8 / 4
    prefix = "base_model.model."
    merged = 0
    for name, tensor in saved.items():
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix(".base_layer.weight")
            delta = saved[f"{module}.lora_B.default.weight"] @ saved[f"{module}.lora_A.default.weight"]
            plain_name = module.removeprefix(prefix) + ".weight"
            torch.testing.assert_close(b[plain_name], tensor + scale * delta, atol=1e-6, rtol=0)
            assert delta.abs().max() > 1e-4  # the adapters were trained
            merged += 1
        elif ".lora_" not in name:
            assert torch.equal(b[name.removeprefix(prefix)], tensor), name
    assert merged == 4  # q, k, v, o of the one layer
    check_export(sharded, restored(ranks, ranks / "checkpoints" / "step-1"))
    check_export(single, restored(one, one / "checkpoints" / "step-1"))


def test_adapter_export_is_a_peft_directory_on_its_base(lora_runs: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    ranks, _ = lora_runs
    out = export(ranks, tmp_path / "adapter", adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(export(ranks, tmp_path / "merged")).eval()
    config = json.loads((out / "adapter_config.json").read_text())
    # the warm start trained the base weights too: they come along, named by absolute path
    assert config["base_model_name_or_path"] == str(out / "base")
    assert config["r"] == 4 and config["lora_alpha"] == 8
    adapters = load_file(str(out / "adapter_model.safetensors"))
    assert adapters and all("lora_" in k for k in adapters)
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    with warnings.catch_warnings():  # peft reads a transformers alias deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        loaded = [PeftModel.from_pretrained(base, out), AutoPeftModelForCausalLM.from_pretrained(out)]
    for model in loaded:
        for messages in PROMPTS:
            ids = TOK.chat_prompt(messages)
            torch.testing.assert_close(logits(model.eval(), ids), logits(merged, ids),
                                       atol=1e-5, rtol=0)


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``main(argv)`` fails with exit code 2 and one line on stderr, which it returns."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line(plain: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    assert "neither a run directory" in bad(capsys, str(tmp_path), "-o", out)
    assert "neither a run directory" in bad(capsys, "best", "-o", out)
    assert "neither a run directory" in bad(capsys, str(plain / "config.yaml"), "-o", out)
    assert "no checkpoint of step 7 (its steps: 0, 1, 2)" in bad(capsys, str(plain), "--step", "7",
                                                                 "-o", out)
    assert "drop --step" in bad(capsys, str(plain / "checkpoints" / "step-1"), "--step", "1",
                                "-o", out)
    assert "trained no LoRA adapters" in bad(capsys, str(plain), "--adapter", "-o", out)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    assert f"-o {full} exists and is not empty" in bad(capsys, str(plain), "-o", str(full))
    assert not Path(out).exists()

    copy = tmp_path / "copy"  # a checkpoint whose files do not match its manifest
    shutil.copytree(plain, copy, ignore=shutil.ignore_patterns("final"))
    with (copy / "checkpoints" / "step-2" / "trainer.pt").open("ab") as f:
        f.write(b"x")
    assert "is damaged" in bad(capsys, str(copy / "checkpoints" / "step-2"), "-o", out)
    outside = tmp_path / "outside"
    shutil.copytree(plain / "checkpoints" / "step-1", outside)
    assert "outside its run directory" in bad(capsys, str(outside), "-o", out)
    assert not Path(out).exists() and not list(tmp_path.glob(".out*"))


def test_the_command_line(plain: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    out = tmp_path / "hf"
    ok = forked.run([sys.executable, "-m", "orchestrator.export", str(plain), "-o", str(out)],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip().splitlines()[-1] == str(out) and (out / "model.safetensors").is_file()


def test_dtype_and_file_modes_as_the_user_asks(plain: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    old = os.umask(0o027)
    try:
        out = export(plain, tmp_path / "bf16", dtype="bfloat16")
    finally:
        os.umask(old)
    assert {w.dtype for w in weights(out).values()} == {torch.bfloat16}
    config = json.loads((out / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    # every file as a new file of the user's would be (0o666 less the umask), the weights too
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes
    assert out.stat().st_mode & 0o777 == 0o750
    assert {w.dtype for w in weights(export(plain, tmp_path / "as_is")).values()} == {torch.float32}


def test_an_adapter_on_an_untouched_base_names_it_as_the_run_did(
        plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a LoRA run on a Hugging Face directory the run named by a relative path, its base
    # weights untouched (no warm start): the adapter names that path as written
    monkeypatch.chdir(tmp_path)
    export(plain, tmp_path / "models" / "tiny")
    cfg = quick_config("smoke", *LORA)
    OmegaConf.update(cfg, "model", {"_target_": "orchestrator.models.policy.pretrained_policy",
                                    "path": "models/tiny", "dtype": "float32", "device": "cpu",
                                    "fp32_head": False}, merge=False)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    recipe = TrainerRecipe(trainer=section(cfg, "trainer"), model=section(cfg, "model"),
                           algo=section(cfg, "algo"), torch_threads=1)
    trainer = recipe.build()
    try:
        CheckpointStore(run_dir / "checkpoints").save(0, trainer.snapshot().write)
    finally:
        anyio.run(trainer.aclose)
    out = export(run_dir, tmp_path / "adapter", adapter=True)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "models/tiny" and not (out / "base").exists()
