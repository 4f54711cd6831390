"""``python -m orchestrator.export SOURCE -o DIR [--step N] [--adapter]``: a checkpoint out as a
Hugging Face directory that ``transformers``, vLLM and ``model=hf model.path=DIR`` load.

SOURCE is a run directory (its latest checkpoint: the more recently written of ``final``,
which a run writes when it ends, and its newest valid ``step-N``; ``--step N`` for
``checkpoints/step-N``) or one checkpoint directory of a run (``<run_dir>/checkpoints/…``).
The run's own ``config.yaml`` says which model the weights belong to: the model is built from
its ``model`` node (on the CPU), wrapped with the run's LoRA adapters if it had them, and the
checkpoint loaded into it, as a resumed trainer loads it:

* one process: ``model/model.safetensors`` (tied weights saved once);
* trainer ranks: the ``shards/`` of ``torch.distributed.checkpoint``, read at world size one,
  which gathers them to full tensors; the optimiser's state is not read;
* LoRA: merged into the base weights (``W0 + alpha / r · B A``, ``peft``'s
  ``merge_and_unload``) by default; with ``--adapter``, a ``peft`` adapter directory instead
  (``adapter_config.json``, ``adapter_model.safetensors``), its base model named in
  ``base_model_name_or_path``: the run's ``model.path`` when the checkpoint's base weights
  are still that model's, else ``DIR/base/``, written beside it (the warm start trains the
  base weights too, and a tiny model has no directory of its own).

DIR gets ``model.safetensors`` (tied weights once, ``tie_word_embeddings`` in the config, so
``from_pretrained`` ties them again), ``config.json``, ``generation_config.json`` and the
tokenizer with its chat template: a Hugging Face tokenizer's own files, or for the tiny model
the character tokenizer as an equivalent fast tokenizer
(:meth:`~orchestrator.models.tokenizer.CharTokenizer.to_hf`). The weights keep the dtype the
checkpoint holds them in (a trainer's float32 master weights stay float32). The directory is
written beside DIR and renamed into place, so a failed export leaves nothing behind.

Bad input is one line (``error: …``, exit code 2): a SOURCE that is neither kind, a DIR that
exists and is not empty, a step with no checkpoint, ``--adapter`` for a run without LoRA, a
checkpoint whose files do not match its manifest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.checkpoint import MANIFEST, CheckpointStore, CorruptCheckpoint, verify
from orchestrator.errors import ConfigError
from orchestrator.models.policy import Policy, build_policy, checkpoint_dir
from orchestrator.models.tokenizer import CharTokenizer, Tokenizer
from orchestrator.trainer.lora import LoraConfig, base_weights
from orchestrator.trainer.snapshot import SHARDS, TRAINER_STATE, WEIGHTS

CONFIG = "config.yaml"  # the run's resolved config, written by RunDir
BASE = "base"  # --adapter: the base model's directory inside the export, when it needs one


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to export and the run it belongs to."""

    path: Path
    run_dir: Path

    @property
    def sharded(self) -> bool:
        """Whether the weights are trainer ranks' shards; where a ``final`` holds both (a run
        resumed at another world size wrote it again), the newer ones."""
        shards, weights = self.path / SHARDS / ".metadata", self.path / "model" / WEIGHTS
        if not weights.is_file() or not shards.is_file():
            return shards.is_file()
        return shards.stat().st_mtime > weights.stat().st_mtime


def locate(source: str | Path, step: int | None = None) -> Checkpoint:
    """The checkpoint ``source`` names (a run directory, with ``step`` one of its periodic
    checkpoints; or a checkpoint directory of a run); one line if it names none."""
    path = Path(source)
    if (path / CONFIG).is_file() and (path / "checkpoints").is_dir():
        return Checkpoint(_in_run(path, step), path)
    if _is_checkpoint(path):
        if step is not None:
            raise ConfigError(f"--step {step} picks a checkpoint of a run directory, but {path} "
                              "is a checkpoint directory already: drop --step or give the run")
        run_dir = path.parent.parent
        if path.parent.name != "checkpoints" or not (run_dir / CONFIG).is_file():
            raise ConfigError(f"{path} is a checkpoint outside its run directory (no "
                              f"../../{CONFIG}), which says what model it holds: export it from "
                              "<run_dir>/checkpoints/ where the run wrote it")
        return Checkpoint(path, run_dir)
    if (path / CONFIG).is_file():
        raise ConfigError(f"{path} is a run directory with no checkpoints/ (the run was started "
                          "with no checkpoint.every or every_s, or ended before its first one)")
    raise ConfigError(f"{path} is neither a run directory (with {CONFIG} and checkpoints/) nor "
                      "a checkpoint directory (<run_dir>/checkpoints/step-N or final)")


def _is_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() and (
        (path / "model" / WEIGHTS).is_file() or (path / SHARDS).is_dir())


def _in_run(run_dir: Path, step: int | None) -> Path:
    store = CheckpointStore(run_dir / "checkpoints")
    if step is not None:
        if step not in store.steps():
            have = ", ".join(map(str, store.steps())) or "none"
            raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of step {step} "
                              f"(its steps: {have})")
        return store.path(step)
    found = [p for p in (store.latest_valid(), run_dir / "checkpoints" / "final")
             if p is not None and _is_checkpoint(p)]
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint to export")
    return max(found, key=lambda p: (p / TRAINER_STATE).stat().st_mtime)


def run_config(run_dir: Path) -> tuple[dict[str, Any], LoraConfig | None]:
    """The ``model`` node of the run's config (on the CPU) and its LoRA, if any."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.load(run_dir / CONFIG)
    assert isinstance(cfg, DictConfig)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if not isinstance(model, dict):
        raise ConfigError(f"{run_dir / CONFIG} has no model node")
    model = {str(k): v for k, v in model.items()}
    if "device" in model:
        model["device"] = "cpu"
    lora = OmegaConf.select(cfg, "trainer.lora")
    return model, LoraConfig.of(OmegaConf.to_container(lora) if lora is not None else None)  # type: ignore[arg-type]


def load(checkpoint: Checkpoint) -> tuple[Policy, torch.nn.Module, LoraConfig | None]:
    """The run's policy and the model holding ``checkpoint``'s weights (``peft``-wrapped for a
    LoRA run)."""
    if (checkpoint.path / MANIFEST).is_file():
        try:
            verify(checkpoint.path)
        except CorruptCheckpoint as e:
            raise ConfigError(f"{checkpoint.path} is damaged: {e}") from None
    node, lora = run_config(checkpoint.run_dir)
    policy = build_policy(node)
    model = policy.model
    if lora is not None:
        model = lora.wrap(model)
    if checkpoint.sharded:
        _load_shards(model, checkpoint.path / SHARDS)
    else:
        _load_weights(model, checkpoint.path / "model" / WEIGHTS)
    return policy, model.eval(), lora


def _load_weights(model: torch.nn.Module, file: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(file))
    model.to(_stored_dtype(w.dtype for w in weights.values()))
    result = model.load_state_dict(weights, strict=False)
    tied = _tied_names(model)  # saved once, under the first name
    missing = [n for n in result.missing_keys if n not in tied]
    if result.unexpected_keys or missing:
        raise ConfigError(f"{file} does not hold the run's model: "
                          f"{len(missing)} of its weights missing ({', '.join(missing[:3])}), "
                          f"{len(result.unexpected_keys)} unknown "
                          f"({', '.join(result.unexpected_keys[:3])})")


def _load_shards(model: torch.nn.Module, shards: Path) -> None:
    """The model's full tensors from every rank's shards (the optimiser's are left unread)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    metadata = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    model.to(_stored_dtype(getattr(getattr(m, "properties", None), "dtype", None)
                           for name, m in metadata.items() if name.startswith("model.")))
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # one process, no group: what is meant, said as a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        dcp.load(state, checkpoint_id=str(shards), no_dist=True)
    set_model_state_dict(model, state["model"])


def _stored_dtype(dtypes: Any) -> torch.dtype:
    """The floating dtype the checkpoint holds the weights in (float32 if none is)."""
    return next((d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point),
                torch.float32)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names of tensors sharing another's storage (a tied LM head): saved once, by its first
    name."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tied.add(name)
        seen.add(ptr)
    return tied


def export(source: str | Path, out: str | Path, step: int | None = None,
           adapter: bool = False) -> Path:
    """Write ``source``'s checkpoint (see the module's docstring) into ``out``; ``out``."""
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"-o {out} exists and is not empty: give a new or empty directory")
    checkpoint = locate(source, step)
    node, lora = run_config(checkpoint.run_dir)
    if adapter and lora is None:
        raise ConfigError(f"--adapter: the run in {checkpoint.run_dir} trained no LoRA adapters "
                          "(trainer.lora.r is 0); export it without --adapter")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per file written is noise for a tiny model
    policy, model, lora = load(checkpoint)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter:
            _write_adapter(model, node, policy.tokenizer, tmp, out)
        else:
            if lora is not None:
                model = model.merge_and_unload()  # type: ignore[operator]
            _write_model(model, policy.tokenizer, tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_model(model: torch.nn.Module, tokenizer: Tokenizer, directory: Path) -> None:
    model.save_pretrained(str(directory))  # type: ignore[operator]  # config, generation config
    _write_tokenizer(tokenizer, directory)


def _write_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.to_hf().save_pretrained(str(directory))
    else:
        tokenizer.save_pretrained(directory)
    if not (directory / "tokenizer_config.json").is_file():
        raise ConfigError(f"the run's tokenizer ({type(tokenizer).__name__}) wrote no Hugging "
                          "Face tokenizer files; the export would not load without one")


def _write_adapter(model: torch.nn.Module, node: Mapping[str, Any], tokenizer: Tokenizer,
                   directory: Path, final: Path) -> None:
    """A ``peft`` adapter directory in ``directory`` (renamed to ``final`` afterwards), and
    the base model it applies to in ``base/`` unless the run's model directory is that base."""
    trained = base_weights(model.state_dict())
    start = build_policy(node)  # the model the run started from
    start.model.to(next(iter(trained.values())).dtype)
    path = checkpoint_dir(node)
    same = all(torch.equal(trained[name], tensor)
               for name, tensor in start.model.state_dict().items())
    if path is not None and same:
        base = str(Path(path).absolute())
    else:  # trained by the warm start, or a model built from config: written here
        start.model.load_state_dict(trained)
        _write_model(start.model, tokenizer, directory / BASE)
        base = str(final / BASE)
    for config in model.peft_config.values():  # type: ignore[union-attr]
        config.base_model_name_or_path = base
        config.task_type = "CAUSAL_LM"  # AutoPeftModelForCausalLM's
    with warnings.catch_warnings():  # peft looks for base/ before the rename puts it there
        warnings.filterwarnings("ignore", message="Could not find a config file",
                                category=UserWarning)
        model.save_pretrained(str(directory))  # type: ignore[operator]
    _write_tokenizer(tokenizer, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.export",
        description="Write a run's checkpoint as a Hugging Face directory.")
    parser.add_argument("source", metavar="SOURCE",
                        help="a run directory (its latest checkpoint) or a checkpoint directory")
    parser.add_argument("-o", "--out", required=True, metavar="DIR",
                        help="the directory to write (new, or empty)")
    parser.add_argument("--step", type=int, help="the run's checkpoint of this step")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: a peft adapter directory instead of merged weights")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out, step=args.step, adapter=args.adapter)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
