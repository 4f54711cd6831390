#!/usr/bin/env bash
# Set up if needed, then run an experiment: bash scripts/run.sh [experiment=<name>] [key=value …]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m orchestrator "$@"
