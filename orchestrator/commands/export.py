"""``python -m orchestrator.export SOURCE -o DIR [--step N] [--adapter] [--dtype D]``: a checkpoint
out as a Hugging Face directory that ``transformers``, vLLM and ``model=hf model.path=DIR`` load.

SOURCE is a run directory (its latest checkpoint: the more recently written of ``final``,
which a run writes when it ends, and its newest valid ``step-N``; ``--step N`` for
``checkpoints/step-N``, ``--step best`` for the best one ``checkpoint.keep_best`` kept) or one
checkpoint directory of a run (``<run_dir>/checkpoints/…``); see
:mod:`orchestrator.commands.targets`. The run's own ``config.yaml`` says which model the weights
belong to: the model is built from its ``model`` node (on the CPU), wrapped with the run's LoRA
adapters if it had them, and the checkpoint loaded into it, as a resumed trainer loads it:

* one process: ``model/model.safetensors`` (tied weights saved once);
* trainer ranks: the ``shards/`` of ``torch.distributed.checkpoint``, read at world size one,
  which gathers them to full tensors; the optimiser's state is not read;
* LoRA: merged into the base weights (``W0 + alpha / r · B A``, ``peft``'s
  ``merge_and_unload``) by default; with ``--adapter``, a ``peft`` adapter directory instead
  (``adapter_config.json``, ``adapter_model.safetensors``), its base model named in
  ``base_model_name_or_path``: the run's ``model.path`` as the run's config gives it (not
  made absolute) when the checkpoint's base weights are still that model's, else
  ``DIR/base/``, written beside it and named by its absolute path, which ``peft`` finds from
  any working directory (the warm start trains the base weights too, and a tiny model has no
  directory of its own).

DIR gets ``model.safetensors`` (tied weights once, ``tie_word_embeddings`` in the config, so
``from_pretrained`` ties them again), ``config.json``, ``generation_config.json`` and the
tokenizer with its chat template: a Hugging Face tokenizer's own files, or for the tiny model
the character tokenizer as an equivalent fast tokenizer
(:meth:`~orchestrator.models.tokenizer.CharTokenizer.to_hf`). The weights keep the dtype the
checkpoint holds them in (a trainer's float32 master weights stay float32) unless ``--dtype``
(``float32``, ``bfloat16``, ``float16``) names another; ``config.json`` says which. Every file
is readable as the user's umask says (a new file's ``0o666`` less the umask). The directory is
written beside DIR and renamed into place, so a failed export leaves nothing behind.

Bad input is one line (``error: …``, exit code 2): a SOURCE that is neither kind, a DIR that
exists and is not empty, a step with no checkpoint (``best`` for a run that kept none),
``--adapter`` for a run without LoRA, a checkpoint whose files do not match its manifest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from orchestrator.commands.targets import Step, load, locate, parse_step, run_config
from orchestrator.errors import ConfigError
from orchestrator.models.policy import build_policy, checkpoint_dir
from orchestrator.models.tokenizer import CharTokenizer, Tokenizer
from orchestrator.trainer.lora import base_weights

__all__ = ["export", "locate", "main"]

BASE = "base"  # --adapter: the base model's directory inside the export, when it needs one


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(source: str | Path, out: str | Path, step: Step = None,
           adapter: bool = False, dtype: str | None = None) -> Path:
    """Write ``source``'s checkpoint (see the module's docstring) into ``out``, its weights
    in ``dtype`` (None: as the checkpoint holds them); ``out``."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    cast = None if dtype is None else DTYPES[dtype]
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
            _write_adapter(model, node, policy.tokenizer, tmp, out, cast)
        else:
            if lora is not None:
                model = model.merge_and_unload()  # type: ignore[operator]
            if cast is not None:
                model.to(cast)
            _write_model(model, policy.tokenizer, tmp)
        _as_umask_says(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put straight back
    os.umask(mask)
    return mask


def _as_umask_says(directory: Path) -> None:
    """Every file and directory of the export as a new one of the user's gets them (files
    ``0o666``, directories ``0o777``, less the umask): libraries write some with 0600
    (``model.safetensors`` through a private temporary file)."""
    mask = _umask()
    for root, dirs, files in os.walk(directory):
        for name in files:
            os.chmod(Path(root) / name, 0o666 & ~mask)
        for name in dirs:
            os.chmod(Path(root) / name, 0o777 & ~mask)
    os.chmod(directory, 0o777 & ~mask)


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
                   directory: Path, final: Path, cast: torch.dtype | None = None) -> None:
    """A ``peft`` adapter directory in ``directory`` (renamed to ``final`` afterwards), and
    the base model it applies to in ``base/`` unless the run's model directory is that base;
    the weights in ``cast`` (None: as they are)."""
    trained = base_weights(model.state_dict())
    start = build_policy(node)  # the model the run started from
    start.model.to(next(iter(trained.values())).dtype)
    path = checkpoint_dir(node)
    same = all(torch.equal(trained[name], tensor)
               for name, tensor in start.model.state_dict().items())
    if path is not None and same:
        # the name the run gave it (model.path as written; a GGUF's converted directory)
        base = str(node["path"]) if node.get("path") is not None else str(path)
    else:  # trained by the warm start, or a model built from config: written here, named
        start.model.load_state_dict(trained)  # by where it will be (peft resolves a
        if cast is not None:  # relative name from the working directory, not the adapter's)
            start.model.to(cast)
        _write_model(start.model, tokenizer, directory / BASE)
        base = str(final / BASE)
    if cast is not None:
        model.to(cast)
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
    parser.add_argument("--step", metavar="N|best",
                        help="the run's checkpoint of step N, or the best one "
                             "(checkpoint.keep_best)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: a peft adapter directory instead of merged weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="the weights' dtype in the export (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        step = None if args.step is None else parse_step(args.step)
        out = export(args.source, args.out, step=step, adapter=args.adapter, dtype=args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
