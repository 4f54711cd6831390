"""orchestrator.allocator: with it, a worker thread that allocates and frees the same large
tensor step after step soon reuses freed memory; with glibc's defaults every step maps it
afresh and page-faults all of it in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, resource, sys, threading
from orchestrator.allocator import keep_freed_memory
kept = keep_freed_memory()
import torch
torch.set_num_threads(1)
faults = []
def steps():
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t = torch.ones(16_000_000)  # 64 MB, every page touched
        del t
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps({"kept": kept, "faults": faults}))
"""

PAGES = 64_000_000 // 4096


def faults(**env: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          check=True, env={**os.environ, **env}, timeout=120)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_worker_threads_freed_memory_is_reused_not_faulted_in_again() -> None:
    kept = faults()
    assert kept["kept"] is True
    steps: list[int] = kept["faults"]  # type: ignore[assignment]
    assert steps[0] > PAGES // 2  # the first 64 MB come from the kernel
    # the heap grows while freed blocks are too small for an aligned request, until they
    # coalesce (8 steps here); from then on, no new page
    assert all(n < PAGES // 20 for n in steps[-3:]), kept

    system = faults(POLYRL_MALLOC="system")  # glibc's defaults: mapped afresh every time
    assert system["kept"] is False
    assert all(n > PAGES // 2 for n in system["faults"]), system  # type: ignore[attr-defined]
