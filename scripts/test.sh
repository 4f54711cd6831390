#!/usr/bin/env bash
# Set up if needed, check the import contracts, then run the whole test suite:
#   bash scripts/test.sh [pytest args …]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/docker_setup.sh  # Docker engine + sandbox image for tests/sandboxes/docker
.venv/bin/lint-imports  # the import contracts in pyproject.toml (ARCHITECTURE.md's dependency rule)
exec .venv/bin/python -m pytest "$@"
