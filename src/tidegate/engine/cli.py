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
import threading

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
    parser.add_argument("--max-batch-tokens", type=int, default=96,
                        help="per-step token budget: bounds a step's time, hence the inter-token gap")
    parser.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV-cache capacity in tokens")
    parser.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                        help="prefill each prompt in one step (for comparison)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="compute every prompt from scratch instead of sharing the KV blocks of prefixes "
                             "computed before (for comparison)")
    parser.add_argument("--fault-injection", action="store_true",
                        help="serve POST /admin/slow (body: a factor >= 1) that makes every step that many times "
                             "slower; for testing how a gateway's limits follow a slow replica, never in production")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="larger request bodies get 413 (default 4 MiB, the gateway's default limit; "
                             "`tidegate serve` sets it above its server.max_body_bytes)")
    parser.add_argument("--step-log", help="write one CSV line per engine step here (start_s, step_s, prefill "
                                           "tokens, decoding sequences, summed context); {pid} is replaced by the "
                                           "process id. For `tidegate sim calibrate --step-log`")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before exiting")


def run(args: argparse.Namespace) -> int:
    from tidegate.engine.server import EngineOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("max_num_seqs", "max_batch_tokens", "kv_cache_tokens", "max_body_bytes"):
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
        enable_prefix_caching=args.enable_prefix_caching,
        fault_injection=args.fault_injection,
        max_body_bytes=args.max_body_bytes,
    )
    # The engine thread re-takes the GIL after every torch op; with the default 5 ms switch
    # interval it can wait that long behind the HTTP thread, many times per step
    sys.setswitchinterval(float(os.environ.get("TIDEGATE_ENGINE_SWITCH_INTERVAL_S", "0.0005")))
    return _serve(options, args.host, args.port, args.drain_timeout, args.step_log)


class _HttpThread:
    """The asyncio side (aiohttp, uvloop when installed) in a background thread."""

    def __init__(self, server, host: str, port: int) -> None:  # type: ignore[no-untyped-def]
        self.server = server
        self.loop = _new_event_loop()
        self._runner = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)
        self._thread.start()
        self.call(self._start(host, port))

    def call(self, coroutine, timeout_s: float | None = None):  # type: ignore[no-untyped-def]
        """Runs a coroutine on the asyncio thread and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def _start(self, host: str, port: int) -> None:
        from aiohttp import web

        self._runner = web.AppRunner(self.server.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        await self.server.close()

    def shutdown(self) -> None:
        self.call(self._shutdown(), timeout_s=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def _serve(options, host: str, port: int, drain_timeout_s: float, step_log: str | None = None) -> int:  # type: ignore[no-untyped-def]
    from tidegate.engine.server import EngineServer

    server = EngineServer(options)
    http = _HttpThread(server, host, port)
    log.info("listening on http://%s:%d, loading %s", host, port, options.model)
    stopping = threading.Event()
    drained = threading.Event()

    async def drain_then_stop() -> None:
        log.info("draining (up to %.0f s)", drain_timeout_s)
        await server.drain(drain_timeout_s)
        drained.set()
        if server.engine_loop is not None:
            server.engine_loop.stop()  # returns the main thread from run_forever

    def on_signal(_signum: int, _frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            http.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain_then_stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if server.serves_embeddings:
            model = server.load_embedding_model()
            http.call(server.attach_embeddings(model))
        else:
            from tidegate.engine.builder import build_generation_engine

            built = build_generation_engine(options, server.metrics)  # torch in the main thread
            http.loop.call_soon_threadsafe(server.attach_generation, built)
            if step_log is not None:
                built.loop.step_log = open(step_log.replace("{pid}", str(os.getpid())), "a", buffering=1)
            if not stopping.is_set():
                built.loop.run_forever(http.loop)
            if built.loop.step_log is not None:
                built.loop.step_log.close()
    except Exception:
        log.exception("loading %s failed", options.model)
        http.shutdown()
        return 1
    while not drained.wait(timeout=0.5):
        pass
    http.shutdown()
    return 0
