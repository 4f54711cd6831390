#!/usr/bin/env bash
# Set up if needed, check the import contracts, then run the whole test suite:
#   bash scripts/test.sh [pytest args …]
# The tests marked `vllm` run a second time in .venv-vllm, where vLLM is installed
# (scripts/setup_vllm.sh says why it is a separate environment); in .venv they skip.
#
#   bash scripts/test.sh --quick [pytest args …]
# is the inner loop: the unit and fast integration tests (not marked slow, docker, ray or
# vllm), with the import contracts and the docs build, in .venv alone (no .venv-vllm, no
# Docker set-up): about two minutes after set-up on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  shift
  bash scripts/setup.sh
  .venv/bin/lint-imports
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
  exec .venv/bin/python -m pytest -m "not slow and not docker and not ray and not vllm" "$@"
fi
bash scripts/setup.sh
bash scripts/setup_vllm.sh
bash scripts/docker_setup.sh  # Docker engine + sandbox image for tests/sandboxes/docker
.venv/bin/lint-imports  # the import contracts in pyproject.toml (ARCHITECTURE.md's dependency rule)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site  # docs/: a broken link or page fails here (not --quiet: it hides the warnings --strict counts)
status=0
.venv/bin/python -m pytest "$@" || status=$?
echo "test: engine=vllm's tests in .venv-vllm" >&2
vllm_status=0
.venv-vllm/bin/python -m pytest -m vllm "$@" || vllm_status=$?
if [ "$vllm_status" -ne 0 ] && [ "$vllm_status" -ne 5 ]; then  # 5: none selected by "$@"
  status=$vllm_status
fi
exit "$status"
