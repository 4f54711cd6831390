#!/usr/bin/env bash
# Make a Docker engine answer and build the sandbox base image; safe to run again.
#   bash scripts/docker_setup.sh
# As root on Debian/Ubuntu: installs docker.io and debootstrap with apt-get when absent, starts
# dockerd in the background when no engine answers, waits for it, then builds the image
# polyrl-sandbox:bookworm-py3 (Debian bookworm with python3: python -m sandboxes.docker
# build-image; a no-op when the image exists). Without root, or
# without apt-get, it only reports what is missing and leaves the sandbox tests to skip.
# It also installs gVisor (Debian's runsc) when apt has it and registers it with Docker as the
# runtime "runsc" (with --network=none) in /etc/docker/daemon.json (a running dockerd reloads it
# on SIGHUP), for sandbox.runtime=runsc; without it runc, Docker's own runtime, is the only one.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "docker_setup: $*" >&2; }
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing docker.io and debootstrap with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
  else
    log "dockerd or debootstrap is missing and this is not root with apt-get; skipping"
    exit 0
  fi
fi

# gVisor: optional (the default sandbox.runtime is runc); registered before dockerd starts, or
# reloaded into a running one with SIGHUP (runtimes are among dockerd's reloadable options).
if [ "$(id -u)" = 0 ] && ! command -v runsc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if apt-cache show runsc >/dev/null 2>&1; then
    log "installing gVisor (runsc) with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends runsc >/dev/null \
      || log "runsc did not install; sandbox.runtime=runsc will be unavailable"
  fi
fi
if [ "$(id -u)" = 0 ] && command -v runsc >/dev/null 2>&1; then
  mkdir -p /etc/docker
  changed=$(python3 - "$(command -v runsc)" <<'PYEOF'
import json, sys
from pathlib import Path
path = Path("/etc/docker/daemon.json")
config = json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else {}
# --network=none: sandboxes have no network (sandbox.network=false), and runsc's own network
# stack refuses the namespace Docker gives a network-less container ("cannot run with network
# enabled in root network namespace"), so a container would not start without it.
wanted = {"path": sys.argv[1], "runtimeArgs": ["--network=none"]}
if config.get("runtimes", {}).get("runsc") != wanted:
    config.setdefault("runtimes", {})["runsc"] = wanted
    path.write_text(json.dumps(config, indent=2) + "\n")
    print("yes")
PYEOF
)
  if [ -n "$changed" ]; then
    log "registered runsc as a Docker runtime in /etc/docker/daemon.json"
    if pid=$(pidof dockerd); then kill -HUP $pid; sleep 1; fi
  fi
fi

if ! docker version >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    log "no Docker engine answers and this is not root; skipping"
    exit 0
  fi
  log "starting dockerd (log: /var/log/dockerd.log)"
  nohup dockerd >/var/log/dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker version >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker version >/dev/null 2>&1; then
    log "dockerd did not answer within 30 s; see /var/log/dockerd.log"
    tail -n 20 /var/log/dockerd.log >&2 || true
    exit 1
  fi
fi

"$PY" -m sandboxes.docker build-image
