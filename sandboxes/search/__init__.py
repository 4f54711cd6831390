"""A mock search service: lexical retrieval over a local corpus behind Search-R1's HTTP API.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": bool}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (without scores:
``{"result": [[document, ...], ...]}``), so existing Search-R1/verl search clients can point at
it. Per-request latency and failures come from a pluggable :class:`FaultModel`; the
:class:`TraceFaultModel` draws them from a fit of PolyTrace tool-call records.
"""

from sandboxes.search.bm25 import BM25Index, Document
from sandboxes.search.client import Attempt, SearchClient, SearchError
from sandboxes.search.latency import TraceFaultModel
from sandboxes.search.server import FaultModel, NoFaults, SearchServer

__all__ = ["Attempt", "BM25Index", "Document", "FaultModel", "NoFaults", "SearchClient",
           "SearchError", "SearchServer", "TraceFaultModel"]
