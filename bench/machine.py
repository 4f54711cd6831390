"""What a benchmark's figures came from, printed with them: the CPU model and core count, and
the spread of repeated runs (one run on a shared machine is not a figure)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine() -> str:
    """``CPU: <model>, <n> cores``: the line a benchmark prints before its figures."""
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores"


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``median (min–max over n runs)``, or the value alone for one run."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (one run)"
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–"
            f"{max(values):.{digits}f} over {len(values)} runs)")
