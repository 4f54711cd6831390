"""Run the mock search server on its own:

    python -m sandboxes.search --corpus corpus.jsonl [--port 8000] [--latency empirical]

The corpus is JSONL in Search-R1's format, one ``{"id": ..., "contents": ...}`` per line.
``--latency none|empirical|parametric`` picks the fault model (the shipped PolyTrace fit, or
``--fit file.json``); ``--time-scale`` multiplies every drawn latency. ``--control`` adds the
``/faults`` endpoint that turns 500s, hangs or slow answers on for a while (a chaos test's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anyio

from sandboxes.search.bm25 import BM25Index, Document
from sandboxes.search.latency import TraceFaultModel
from sandboxes.search.server import FaultModel, NoFaults, SearchServer


def load_corpus(path: Path) -> list[Document]:
    documents = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                documents.append(Document(str(row["id"]), str(row["contents"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"error: {path}:{line_no} is not a {{\"id\", \"contents\"}} record ({e})") from e
    return documents


async def serve(args: argparse.Namespace) -> None:
    faults: FaultModel = NoFaults()
    if args.latency != "none":
        fitted = json.loads(args.fit.read_text()) if args.fit else None
        faults = TraceFaultModel(args.latency, fitted, seed=args.seed)
    index = BM25Index(load_corpus(args.corpus))
    async with SearchServer(index, faults, args.host, args.port, args.time_scale,
                            control=args.control) as server:
        print(f"search server on {server.url}/retrieve ({len(index.documents)} documents, "
              f"latency={args.latency})", flush=True)
        await anyio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sandboxes.search")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--latency", choices=("none", "empirical", "parametric"), default="none")
    parser.add_argument("--fit", type=Path, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="serve POST/GET /faults: turn 500s, hangs or slow answers on")
    args = parser.parse_args()
    if not args.corpus.is_file():
        sys.exit(f"error: --corpus {args.corpus} is not a file")
    try:
        anyio.run(serve, args)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
