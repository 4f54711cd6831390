"""``python -m orchestrator.serve [key=value …]``: a model from ``conf/`` served behind an
OpenAI-compatible URL, for a run's judge (``env.reward=judge env.judge.url=<that URL>``).

The engine is built as a run builds its own (``conf/engine`` with the ``conf/model`` node:
``model=smollm2 engine=torch``, ``model=hf model.path=… engine=vllm``), from the model's own
weights, with no trainer beside it, and put behind
:class:`~orchestrator.gateway.serve.ModelServer`. Once it is up the command prints
``url=<base URL>`` (the last line it prints; ``--port 0`` picks a free port) and serves until
SIGINT or SIGTERM. ``--api-key-env VAR`` makes it require the key in ``$VAR`` (the judge's
``env.judge.api_key_env=VAR`` sends it).

Why a process of its own rather than an engine inside the training run: the judge's engine then
never competes with the policy's event loop or its weight syncs, its placement is the user's
(another GPU, another machine), and the run gets the judge as plain data, a URL, the same way
it gets a hosted one. A bad key or value is one line (``error: …``, exit status 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace

import anyio

from orchestrator.builders import engine_of
from orchestrator.config.read import CONF, report
from orchestrator.config.run import run_config
from orchestrator.engines.placement import Placement
from orchestrator.errors import ConfigError
from orchestrator.gateway.serve import ModelServer
from orchestrator.models.policy import build_tokenizer


async def serve(overrides: list[str], host: str, port: int, name: str, max_tokens: int,
                api_key: str | None) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    config = run_config(cfg)
    recipe = replace(engine_of(config), placement=Placement(trainer_here=False))
    tokenizer = build_tokenizer(config.model)
    async with recipe.build(None) as engine, ModelServer(  # type: ignore[arg-type]
            engine, tokenizer, model=name, max_tokens=max_tokens, host=host, port=port,
            api_key=api_key) as server:
        print(f"url={server.base_url}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.serve",
        description="Serve a model from conf/ behind an OpenAI-compatible URL (for "
                    "env.reward=judge).", epilog="The last line printed is url=<base URL>.")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="model=…, engine=…, and their keys (model.path=…, model.device=…)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--name", default="judge", help="the model name it answers to")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="the most tokens a reply may have")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="require the key held in $VAR")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] - %(message)s")
    try:
        for override in args.overrides:
            if "=" not in override:
                raise ConfigError(f"{override} is not a key=value override")
        key = None
        if args.api_key_env is not None:
            key = os.environ.get(args.api_key_env)
            if not key:
                raise ConfigError(f"--api-key-env {args.api_key_env}: it is not set")
        anyio.run(serve, args.overrides, args.host, args.port, args.name, args.max_tokens, key,
                  backend="asyncio")  # vLLM's engine runs on asyncio
    except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001 - re-raised unless explained
        return report(error)
    return 0


if __name__ == "__main__":
    from orchestrator.allocator import keep_freed_memory

    keep_freed_memory()  # before any other thread allocates (see orchestrator.allocator)
    sys.exit(main())
