"""Freed memory stays in the process, so later steps reuse it (glibc's malloc).

PyTorch allocates a CPU tensor with ``malloc``. glibc serves each request above its mmap
threshold (128 KiB, rising to at most 32 MiB) with a fresh mapping from the kernel and
unmaps it on ``free``, so a training step's large activations and gradients are page-faulted
in, and zeroed by the kernel, again every step. With mappings off and the heap never trimmed,
they come from the heap: it grows for the first steps (freed blocks are reused once they
coalesce into ones big enough) and then stays put: less system time and steadier steps
(docs/real-model.md has the figures for SmolLM2's trainer).

Worker threads matter: a thread's first allocation gives it an arena of its own, whose
memory comes from mappings whatever the settings, and the trainer's step and the engine's
forward passes run in worker threads. So every thread shares the main arena, and that must be
set before any other thread allocates (glibc fixes its arena limit then):

* :func:`keep_freed_memory` (``mallopt``) is the first thing ``python -m orchestrator`` and a
  trainer rank's process do;
* a Ray actor's process (whose threads Ray started long before) gets the same through its
  environment, which glibc reads as the process starts (:func:`environment`).

The cost: a process's resident memory stays at its high-water mark, and the heap's early
growth adds to it (glibc still trims a free top of the heap past 2 GiB). ``POLYRL_MALLOC=system`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_ABOVE = 2**31 - 1  # bytes of free heap top before glibc gives them back (an int at most)

_kept: bool | None = None


def environment() -> dict[str, str]:
    """The same settings as environment variables, for a process about to start."""
    if os.environ.get("POLYRL_MALLOC") == "system":
        return {}
    return {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": str(TRIM_ABOVE)}


def keep_freed_memory() -> bool:
    """One arena for every thread, no per-allocation mappings and no heap trimming, in this
    process (once; called before other threads allocate); False where that does not apply
    (not Linux with glibc, or ``POLYRL_MALLOC=system``)."""
    global _kept
    if _kept is None:
        _kept = _set()
    return _kept


def _set() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("POLYRL_MALLOC") == "system":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: musl's mallopt does nothing
        return False
    mallopt = libc.mallopt
    return (bool(mallopt(M_ARENA_MAX, 1)) and bool(mallopt(M_MMAP_MAX, 0))
            and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)))
