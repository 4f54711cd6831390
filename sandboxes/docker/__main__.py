"""Sandbox maintenance commands:

    python -m sandboxes.docker build-image [--image NAME:TAG] [--force]
    python -m sandboxes.docker reap [--all]

``build-image`` builds the base image with no registry (see :mod:`sandboxes.docker.image`);
it does nothing when the image exists. ``reap`` removes leaked sandbox containers (owner gone
or expired); ``--all`` removes every container carrying the project's label.
"""

from __future__ import annotations

import argparse
import sys
import time

from sandboxes.api import SandboxError
from sandboxes.docker import engine
from sandboxes.docker.image import DEFAULT_IMAGE, PACKAGES, SUITE, build_image


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.docker")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-image", help="build the base image with debootstrap")
    build.add_argument("--image", default=DEFAULT_IMAGE)
    build.add_argument("--suite", default=SUITE)
    build.add_argument("--packages", default=PACKAGES,
                       help="comma-separated Debian packages to include")
    build.add_argument("--force", action="store_true", help="rebuild even when it exists")
    reap = commands.add_parser("reap", help="remove leaked sandbox containers")
    reap.add_argument("--all", action="store_true", help="every labelled container, live or not")
    parser.add_argument("--docker-host", default=None)
    args = parser.parse_args()
    try:
        client = engine.connect(args.docker_host)
        if args.command == "build-image":
            start = time.perf_counter()
            if build_image(client, args.image, args.suite, args.packages, args.force):
                print(f"built {args.image} in {time.perf_counter() - start:.0f} s")
            else:
                print(f"{args.image} exists (cached)")
        else:
            if args.all:
                removed = sum(engine.remove(client, c.id) for c in engine.labelled(client))
                print(f"removed {removed} labelled container(s)")
            else:
                print(f"removed {engine.reap(client)} leaked container(s)")
    except SandboxError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
