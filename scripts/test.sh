#!/usr/bin/env bash
# Set up if needed, check the import contracts, then run the whole test suite:
#   bash scripts/test.sh [pytest args …]
# The tests marked `vllm` run a second time in .venv-vllm, where vLLM is installed
# (scripts/setup_vllm.sh says why it is a separate environment); in .venv they skip.
#
#   bash scripts/test.sh --quick [pytest args …]
# is the inner loop: the unit and fast integration tests (not marked slow, docker, ray or
# vllm), with the import contracts and the docs build, in .venv alone (no .venv-vllm, no
# Docker set-up): about a minute and a half after set-up on a 2-core machine.
#
# Tests run in POLYRL_TEST_WORKERS processes (pytest-xdist; default 2), a test file to a
# process, so a file's fixtures are built once; Docker tests take turns, and so do Ray tests:
# each kind is one group that one process runs from start to end, started first
# (tests/conftest.py: schedule). Many tests wait on subprocesses, containers and Ray actors rather than
# compute, so two processes fit two cores. POLYRL_TEST_WORKERS=0 runs
# them in this process, one at a time (for pdb, or -x). Commands tests run as
# `python -m <module>` are forked from a server that imported torch and transformers once
# (tests/forked.py), and so are the `python -m orchestrator` runs those commands start (a
# benchmark's runs), and so are the Ray actors' processes of the tests marked ray
# (tests/ray_worker.py); POLYRL_TEST_FORK=0 starts each in a new interpreter instead.
# POLYRL_TEST_CPU=<folder> records what
# each test cost (wall and CPU seconds); python tests/cpu_report.py <folder> sums it by file.
set -euo pipefail
cd "$(dirname "$0")/.."
# A process that crashes ends the run (--max-worker-restart=0): xdist would otherwise start a
# new one and run the crashed test again (a retry that hides the crash), and after a crash it
# once left the run waiting until CI's time limit.
workers=(-n "${POLYRL_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --max-worker-restart=0)
if [ "${1:-}" = "--quick" ]; then
  shift
  bash scripts/setup.sh
  .venv/bin/lint-imports
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
  exec .venv/bin/python -m pytest "${workers[@]}" -m "not slow and not docker and not ray and not vllm" "$@"
fi
bash scripts/setup.sh
bash scripts/setup_vllm.sh
bash scripts/docker_setup.sh  # Docker engine + sandbox image for tests/sandboxes/docker
.venv/bin/lint-imports  # the import contracts in pyproject.toml (ARCHITECTURE.md's dependency rule)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site  # docs/: a broken link or page fails here (not --quiet: it hides the warnings --strict counts)
status=0
.venv/bin/python -m pytest "${workers[@]}" "$@" || status=$?
echo "test: engine=vllm's tests in .venv-vllm" >&2
vllm_status=0
.venv-vllm/bin/python -m pytest "${workers[@]}" -m vllm "$@" || vllm_status=$?
if [ "$vllm_status" -ne 0 ] && [ "$vllm_status" -ne 5 ]; then  # 5: none selected by "$@"
  status=$vllm_status
fi
exit "$status"
