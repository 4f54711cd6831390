"""``bench.judge`` at its smoke size: three short runs (``exact``, a 50 ms judge server, one
that hangs one call in 8) end to end; the hangs are met and counted, no sample of the judge run
is left unscored, and the headline is the judge's samples/s over ``exact``'s."""

from __future__ import annotations

import re

import pytest
from bench_smoke import run_bench


@pytest.mark.slow  # three runs in subprocesses (about 25 s); left out of scripts/test.sh --quick
def test_judge_smoke_counts_the_hangs_and_scores_every_sample() -> None:
    pytest.importorskip("pyarrow", reason="env=dataset needs the data extra")
    _, ratio, out = run_bench("judge", expect="judge_vs_exact")
    assert ratio > 0
    assert "judge_unscored=0" in out.splitlines()
    timeouts = re.search(r"^judge_hang_timeouts=(\d+)$", out, flags=re.MULTILINE)
    assert timeouts is not None and int(timeouts.group(1)) >= 1
