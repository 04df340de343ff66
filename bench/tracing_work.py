"""Tracing's own work per request, in one process, without the rest of a request around it.

    python bench/tracing_work.py [--requests 20000] [--rounds 5]
    python bench/tracing_work.py --instructions      # instructions a request, by stage (needs valgrind)

Drives the tracer's hooks as the proxy calls them for a request under overload control (admitted,
an attempt, its answer, the end, where the exporter encodes its spans), sampling 1.0, into the
built-in exporter (not started: nothing is sent), which takes a batch off its queue as its export task
does when one is due. Prints microseconds per request of the request's way (the hooks and the
encoding) and of the batching, best of rounds. Live, interleaved with the
rest of a request, the same work costs more (bench/gateway_overhead.py --tracing measures that).

--instructions: the same loop under callgrind, stopped after each stage in turn (`--upto`), at two
request counts; the difference divided by the requests between them is the instructions a request
of the stages so far, exact and unmoved by other load on the machine (CPU time is not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from prometheus_client import CollectorRegistry  # noqa: E402

from stage_instructions import print_stages  # noqa: E402
from tidegate.gateway.trace_export import OtlpHttpExporter  # noqa: E402
from tidegate.gateway.tracing import Tracing, TracingSettings  # noqa: E402
from tidegate.gateway.validation import Endpoint  # noqa: E402
from tidegate.telemetry.otlp import export_request_head  # noqa: E402


class Replica:
    def __init__(self, number: int) -> None:
        self.replica_id = f"mock#{number}@127.0.0.1:{8000 + number}"
        self.upstream_model = "mock"
        self.connections = SimpleNamespace(endpoint=SimpleNamespace(host="127.0.0.1", port=8000 + number))


class Usage:  # overload control's: the answer's usage read (the proxy then skips `answered`)
    reported = 16
    prompt_tokens = 12

    def completion_tokens(self) -> int:
        return 16


STAGES = ("ticket", "start", "admitted", "upstream", "attempt_ended", "answered", "end", "batch")


def run(requests: int, upto: str = "batch") -> tuple[float, float, int]:
    """(request path s, batching s, spans) for `requests` requests."""
    exporter = OtlpHttpExporter("http://127.0.0.1:9", {"service.name": "tidegate"}, scope_version="0",
                                registry=CollectorRegistry())
    tracing = Tracing(TracingSettings(), exporter)
    request = SimpleNamespace(traceparent=None, tracestate=None, path=b"/v1/chat/completions")
    identity = SimpleNamespace(tenant="default", tier=None)
    replicas = [Replica(number) for number in range(4)]
    usage = Usage()
    clock = time.monotonic
    request_path_s = batching_s = 0.0
    spans = 0
    started = time.process_time()
    last = STAGES.index(upto)
    for number in range(requests):
        ticket = SimpleNamespace(tier="default", future=None, response_headers=b"x-ratelimit-limit-requests: 100\r\n",
                                 predicted_wait_s=None, dispatched_s=clock())
        if last < 1:
            continue
        trace = tracing.start(request, Endpoint.CHAT, b"5f3a9c1e-%x" % number)
        replica = replicas[number % 4]
        for stage in STAGES[2:last + 1]:
            if stage == "admitted":
                trace.admitted(identity, ticket, usage)
            elif stage == "upstream":
                trace.upstream_headers(replica)
            elif stage == "attempt_ended":
                trace.attempt_ended(None)
            elif stage == "answered":
                pass  # with overload control its `_Usage` reads the answer's usage, not the trace
            elif stage == "end":
                trace.end("mock", 200, replica.replica_id, None)
        if last < STAGES.index("end"):
            continue
        if last == STAGES.index("end"):
            exporter._pending.clear()
            exporter._pending_counts.clear()
            exporter._pending_spans = 0
            continue
        if exporter._pending_spans >= exporter._max_batch_spans:  # a batch is due, as the export task sees it
            batching_started = time.process_time()
            request_path_s += batching_started - started
            batch, count = exporter._take_batch()
            export_request_head({"service.name": "tidegate"}, "tidegate", "0", sum(map(len, batch)))
            spans += count
            started = time.process_time()
            batching_s += started - batching_started
    request_path_s += time.process_time() - started
    return request_path_s, batching_s, spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--upto", choices=STAGES, default="batch", help="stop each request after this stage")
    parser.add_argument("--instructions", action="store_true", help="instructions a request by stage (valgrind)")
    args = parser.parse_args()
    if args.instructions:
        return print_stages(__file__, list(STAGES))
    if args.upto != "batch":
        run(args.requests, args.upto)
        return 0
    results = [run(args.requests) for _ in range(args.rounds)]
    path_s = min(result[0] for result in results)
    batch_s = min(result[1] for result in results)
    spans = results[0][2]
    print(f"{args.requests} requests, {spans / args.requests:.2f} spans each (encoded), best of {args.rounds}: "
          f"request path {path_s / args.requests * 1e6:.2f} us  batching {batch_s / args.requests * 1e6:.2f} us"
          f"  total {(path_s + batch_s) / args.requests * 1e6:.2f} us a request (the ticket-like record the bench"
          f" makes for each request included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
