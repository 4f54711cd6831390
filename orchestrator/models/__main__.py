"""``python -m orchestrator.models import-gguf [GGUF] [--out DIR]``: a GGUF file (default: the
packaged SmolLM2-135M-Instruct) into a Hugging Face directory that ``model=hf model.path=DIR``
and vLLM load like any checkpoint."""

from __future__ import annotations

import argparse
import sys

from orchestrator.errors import ConfigError
from orchestrator.models.gguf import PACKAGED, converted, import_gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.models")
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face directory")
    imp.add_argument("gguf", nargs="?", default="smollm2",
                     help=f"a .gguf path or a packaged model ({', '.join(PACKAGED)}; the default)")
    imp.add_argument("--out", help="the directory to write (default: the cache, reused by model=smollm2)")
    args = parser.parse_args(argv)
    try:
        out = import_gguf(args.gguf, args.out) if args.out else converted(args.gguf)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
