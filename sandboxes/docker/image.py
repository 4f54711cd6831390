"""Building the sandbox base image with no registry: debootstrap, then ``docker import``.

``debootstrap --variant=minbase --include=python3 bookworm DIR`` (about a minute, needs root and
Debian's debootstrap; the default mirror is used), docs, locales and apt caches removed, then
the directory is tarred and imported as ``NAME:TAG``. Nothing happens when the image exists, so
a machine that has it works offline. ``python3``, not ``python3-minimal``: the minimal package
lacks much of the standard library (``json``, ``ctypes``, ``sqlite3``, …), which model-written
code imports. A change of contents takes a new tag (:data:`DEFAULT_IMAGE`), so
machines holding an older image build this one instead of using it.
Where a registry is reachable, any image with ``python3`` and ``sleep`` works instead
(``sandbox.image=python:3.12-slim``); no build is needed then.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import docker
import docker.errors

from sandboxes.api import SandboxError

DEFAULT_IMAGE = "polyrl-sandbox:bookworm-py3"
SUITE = "bookworm"
PACKAGES = "python3"  # comma-separated Debian packages on top of minbase
PRUNE = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
         "usr/share/common-licenses", "usr/share/lintian", "usr/share/bug", "usr/share/menu",
         "var/cache/apt", "var/cache/debconf", "var/lib/apt/lists", "var/log")


def image_exists(client: docker.DockerClient, image: str) -> bool:
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_image(client: docker.DockerClient, image: str = DEFAULT_IMAGE, suite: str = SUITE,
                packages: str = PACKAGES, force: bool = False) -> bool:
    """Build ``image`` unless it exists (or ``force``); True when it was built."""
    if image_exists(client, image) and not force:
        return False
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed; run `bash scripts/docker_setup.sh` "
                           "(as root) or `apt-get install debootstrap`")
    repository, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    with tempfile.TemporaryDirectory(prefix="polyrl-image-") as tmp:
        root = Path(tmp) / "rootfs"
        run = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={packages}", suite, str(root)],
            capture_output=True, text=True)
        if run.returncode != 0:
            tail = "\n".join((run.stdout + run.stderr).splitlines()[-5:])
            raise SandboxError(f"debootstrap failed (exit {run.returncode}):\n{tail}")
        for rel in PRUNE:
            shutil.rmtree(root / rel, ignore_errors=True)
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
        client.api.import_image_from_file(str(tarball), repository=repository,
                                          tag=tag or "latest")
    if not image_exists(client, image):
        raise SandboxError(f"docker import did not produce {image}")
    return True
