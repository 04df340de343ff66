"""`tidegate mock-upstream`: a fast mock OpenAI-compatible upstream for tests and benchmarks."""

from __future__ import annotations

import argparse
import asyncio

__all__ = ["configure_parser", "run"]

_DISTRIBUTIONS = ["const", "exp", "lognormal", "uniform"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per response")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="mean time to first token")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="mean inter-token latency")
    parser.add_argument("--ttft-dist", choices=_DISTRIBUTIONS, default="const")
    parser.add_argument("--itl-dist", choices=_DISTRIBUTIONS, default="const")
    parser.add_argument("--sigma", type=float, default=0.5,
                        help="lognormal: log-space std dev; uniform: half-width as a fraction of the mean")
    parser.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered 500")
    parser.add_argument("--stall-after", type=int, default=None,
                        help="stall every answer after this many tokens, the connection left open (a hung replica)")
    parser.add_argument("--embedding-dim", type=int, default=384)
    parser.add_argument("--model", default="mock-model", help="model name in /v1/models")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--precise-timing", action="store_true",
                        help="pace tokens to within ~0.1 ms instead of the event loop's 1 ms tick (busies a core)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")


def run(args: argparse.Namespace) -> int:
    from tidegate.mock.latency import Distribution, LatencyModel
    from tidegate.mock.server import MockConfig, serve

    if not 0.0 <= args.error_rate <= 1.0:
        raise SystemExit("--error-rate must be between 0 and 1")
    config = MockConfig(
        tokens=args.tokens,
        ttft=LatencyModel(args.ttft_ms / 1000.0, Distribution(args.ttft_dist), args.sigma),
        itl=LatencyModel(args.itl_ms / 1000.0, Distribution(args.itl_dist), args.sigma),
        error_rate=args.error_rate,
        embedding_dim=args.embedding_dim,
        model=args.model,
        seed=args.seed,
        precise_timing=args.precise_timing,
        stall_after=args.stall_after,
    )
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve(config, args.host, args.port))
    else:
        asyncio.run(serve(config, args.host, args.port))
    return 0
