"""PolyTrace in and out: typed records, a streaming reader, the run writer, a Perfetto
timeline and the characterisation report (``python -m orchestrator.trace summarize <dir>``).

A small sample of the published traces ships in ``data/`` (:data:`SHIPPED_SAMPLE`), so tests
and the default replay never need the published directory.
"""

from orchestrator.trace.reader import (
    SHIPPED_SAMPLE,
    TraceDir,
    TraceFormatError,
    find_trace_dirs,
    iter_records,
    read_task_distribution,
    step_file,
)
from orchestrator.trace.records import (
    NAMESPACE,
    PackedLengthsRecord,
    RewardTimingRecord,
    RunInfo,
    TaskDistribution,
    ToolCallTrace,
    TurnRecord,
    WorkloadRecord,
)

__all__ = [
    "NAMESPACE", "SHIPPED_SAMPLE", "PackedLengthsRecord", "RewardTimingRecord", "RunInfo",
    "TaskDistribution", "ToolCallTrace", "TraceDir", "TraceFormatError", "TurnRecord",
    "WorkloadRecord", "find_trace_dirs", "iter_records", "read_task_distribution", "step_file",
]
