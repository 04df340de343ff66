"""`tidegate engine`: one embedded engine worker (one replica) behind an OpenAI-compatible API.

Imports nothing heavy at module level: torch is loaded by the server once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

__all__ = ["configure_parser", "run"]

log = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name (tiny-random-llama) or a local HF model directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="compute dtype (default: fp32 for generation, the embeddings module's choice otherwise)")
    parser.add_argument("--quantize", choices=("int8",), default=None, help="dynamic int8 Linear layers (lossy)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    parser.add_argument("--max-batch-tokens", type=int, default=128,
                        help="per-step token budget: bounds a step's time, hence the inter-token gap")
    parser.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV-cache capacity in tokens")
    parser.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                        help="prefill each prompt in one step (for comparison)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before exiting")


def run(args: argparse.Namespace) -> int:
    from tidegate.engine.server import EngineOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("max_num_seqs", "max_batch_tokens", "kv_cache_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    options = EngineOptions(
        model=args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        chunked_prefill=args.chunked_prefill,
    )
    # The engine thread re-takes the GIL after every torch op; with the default 5 ms switch
    # interval it can wait that long behind the HTTP thread, many times per step
    sys.setswitchinterval(float(os.environ.get("TIDEGATE_ENGINE_SWITCH_INTERVAL_S", "0.0005")))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_serve(options, args.host, args.port, args.drain_timeout))


async def _serve(options, host: str, port: int, drain_timeout_s: float) -> int:  # type: ignore[no-untyped-def]
    from aiohttp import web

    from tidegate.engine.server import EngineServer

    server = EngineServer(options)
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("listening on http://%s:%d, loading %s", host, port, options.model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loading = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if loading.done() and loading.exception() is not None:
        log.error("loading %s failed", options.model, exc_info=loading.exception())
        exit_code = 1
    else:
        await stopping
        log.info("draining (up to %.0f s)", drain_timeout_s)
        await server.drain(drain_timeout_s)
    loading.cancel()
    await runner.cleanup()
    await server.close()
    return exit_code
