"""`tidegate serve`: the gateway over the embedded default pool, or over the pools of a YAML config."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

__all__ = ["configure_parser", "run", "GC_YOUNG_THRESHOLD"]

log = logging.getLogger("tidegate.gateway")

# Python's collector walks its youngest generation each time this many more container objects have
# been made than freed since the last walk (CPython's default is 700). A request makes and frees
# dozens, and every object of every request in flight at a walk is walked again and moved on, so at
# 700 a gateway under load walks its in-flight requests hundreds of times a second. With tracing on,
# which kept a few more objects a request alive, the walks were some 18k instructions a request, a
# quarter of tracing's whole cost (docs/observability.md, "The collector"; at 20,000 they are rare).
# Cyclic garbage waits a little longer for its walk; the gateway makes little.
GC_YOUNG_THRESHOLD = 20_000


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (pools of embedded workers or upstream URLs); "
                                         "default: embedded tiny-random-llama + all-MiniLM-L6-v2 workers")
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1, or the config's)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8000, or the config's)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--no-access-log", action="store_true", help="no per-request access log line")


def _report_readiness(task: asyncio.Task[bool]) -> None:
    if task.cancelled():
        return
    if task.result():
        log.info("ready")
    else:
        log.warning("not every pool is ready yet; /ready answers 503 until it is")


def _tune_collector() -> None:
    """Everything made while starting stays for the process's life: out of the collector's walks
    (`gc.freeze`); then the young generation's threshold (`GC_YOUNG_THRESHOLD`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def _serve(config) -> int:
    from tidegate.control.kubernetes_scaler import KubernetesScaleError
    from tidegate.gateway.app import Gateway
    from tidegate.telemetry.otel_sdk import MissingTracingExtra

    try:
        gateway = Gateway(config)
    except (KubernetesScaleError, MissingTracingExtra) as error:
        print(f"tidegate serve: {error}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await gateway.start()
    _tune_collector()
    ready_task = loop.create_task(gateway.wait_ready(timeout_s=gateway.startup_timeout_s))
    ready_task.add_done_callback(_report_readiness)
    await stop.wait()
    ready_task.cancel()
    drained = loop.create_task(gateway.drain())
    for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal stops at once
        loop.add_signal_handler(signum, drained.cancel)
    try:
        await drained
    except asyncio.CancelledError:
        log.warning("stopping without waiting for requests in flight")
    log.info("stopping")
    await gateway.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    from tidegate.config import ConfigError, default_config, load_config
    from tidegate.telemetry.logs import configure_logging

    configure_logging(args.log_level)
    import prometheus_client

    prometheus_client.disable_created_metrics()  # halves /metrics; the _created series help no one here
    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as error:
        print(f"tidegate serve: {error}", file=sys.stderr)
        return 2
    overrides = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.no_access_log:
        overrides["access_log"] = False
    if overrides:
        config = config.model_copy(update={"server": config.server.model_copy(update=overrides)})
    try:
        import uvloop
    except ImportError:  # the gateway still works on the default loop, only slower
        return asyncio.run(_serve(config))
    return uvloop.run(_serve(config))
