"""A mock batching engine with a concurrency knee, for bench/overload.py.

Why not `tidegate mock-upstream`: its latency does not depend on load, so it has no capacity to
overload. This one models iteration-level batching (Orca): every step, each running sequence emits
one token; a step takes `step_ms` up to `knee` running sequences and grows linearly beyond
(memory-bandwidth-bound decode turns compute-bound), so throughput is flat past the knee and
latency grows with concurrency. At most `max_running` sequences run; the rest wait inside the
engine, as in vLLM. TTFT = wait in the engine + one step (prefill is modelled as one step).

`GET /metrics` reports vLLM's gauge names (`vllm:num_requests_running`, `vllm:num_requests_waiting`),
so a gateway's health checks read this engine's load as they would vLLM's, and, for benches, the
peaks of both since the last `POST /admin/reset_peaks` and the time-integrals of both counts
(`knee_waiting_seconds_total`: its rise over a window / the window is the mean engine queue;
`knee_running_seconds_total`: over the window and `--max-running`, the batch's utilisation).

Limits of the model, said plainly: no prefill cost by prompt length, no KV-cache limit, a
constant token count per answer; `POST /admin/slow` with body `2` makes every step twice as long
(the "replica slowed 2x" of the adaptive-slots bar).

Run: python bench/overload_knee_mock.py --port P [--knee 4 --step-ms 25 --max-running 64 --tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import time

import httptools
import orjson


class Sequence:
    __slots__ = ("conn", "remaining", "emitted", "stream", "request_id", "started")

    def __init__(self, conn: "Connection", tokens: int, stream: bool, request_id: int) -> None:
        self.conn = conn
        self.remaining = tokens
        self.emitted = 0
        self.stream = stream
        self.request_id = request_id
        self.started = time.perf_counter()


class Engine:
    def __init__(self, knee: int, step_s: float, max_running: int, tokens: int) -> None:
        self.knee = knee
        self.step_s = step_s
        self.max_running = max_running
        self.tokens = tokens
        self.slowdown = 1.0
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.wake = asyncio.Event()
        self.ids = 0
        self.completed = 0
        self.running_peak = 0
        self.waiting_peak = 0
        self.waiting_s = 0.0  # integral of len(waiting) over time
        self.running_s = 0.0  # integral of len(running) over time: its rise / (window x max_running) is utilisation
        self._counted_at = time.perf_counter()

    def count(self) -> None:
        """Brings the waiting integral and the peaks up to now (called at every change)."""
        now = time.perf_counter()
        self.waiting_s += len(self.waiting) * (now - self._counted_at)
        self.running_s += len(self.running) * (now - self._counted_at)
        self._counted_at = now
        self.running_peak = max(self.running_peak, len(self.running))
        self.waiting_peak = max(self.waiting_peak, len(self.waiting))

    def submit(self, seq: Sequence) -> None:
        self.count()
        self.waiting.append(seq)
        self.count()
        self.wake.set()

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            self.count()
            while self.waiting and len(self.running) < self.max_running:
                seq = self.waiting.popleft()
                if not seq.conn.closed:
                    self.running.append(seq)
            # a sequence whose client left is freed at the step boundary, as vLLM aborts it, not
            # after one more step at the batch size it no longer belongs to
            self.running = [seq for seq in self.running if not seq.conn.closed]
            self.count()
            if not self.running:
                continue
            batch = len(self.running)
            await asyncio.sleep(self.step_s * self.slowdown * max(1.0, batch / self.knee))
            still: list[Sequence] = []
            for seq in self.running:
                if seq.conn.closed:
                    continue  # the client (gateway) left: the engine frees the sequence
                seq.remaining -= 1
                seq.emitted += 1
                seq.conn.token(seq)
                if seq.remaining > 0:
                    still.append(seq)
                else:
                    self.completed += 1
            self.count()
            self.running = still


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Connection(asyncio.Protocol):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.url = b""
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def _respond(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                             % (status, content_type, len(body), body))

    def on_message_complete(self) -> None:
        path = self.url.split(b"?")[0]
        engine = self.engine
        if path == b"/health":
            self._respond(200, b'{"status":"ok"}')
        elif path == b"/metrics":
            engine.count()
            self._respond(200, b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %d\n"
                          b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting %d\n"
                          b"knee_running %d\nknee_waiting %d\nknee_completed %d\nknee_slowdown %g\n"
                          b"knee_running_peak %d\nknee_waiting_peak %d\nknee_waiting_seconds_total %.6f\n"
                          b"knee_running_seconds_total %.6f\n"
                          % (len(engine.running), len(engine.waiting), len(engine.running), len(engine.waiting),
                             engine.completed, engine.slowdown, engine.running_peak, engine.waiting_peak,
                             engine.waiting_s, engine.running_s), b"text/plain")
        elif path == b"/admin/reset_peaks":
            engine.count()
            engine.running_peak, engine.waiting_peak = len(engine.running), len(engine.waiting)
            self._respond(200, b'{"reset":true}')
        elif path == b"/admin/slow":
            engine.slowdown = float(self.body or b"1")
            self._respond(200, b'{"slowdown":%g}' % engine.slowdown)
        elif path in (b"/v1/chat/completions", b"/v1/completions"):
            request = orjson.loads(self.body)
            tokens = min(engine.tokens, int(request.get("max_tokens") or engine.tokens))
            stream = bool(request.get("stream"))
            engine.ids += 1
            seq = Sequence(self, max(1, tokens), stream, engine.ids)
            if stream:
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n")
            engine.submit(seq)
        else:
            self._respond(404, b'{"error":{"message":"no route","type":"invalid_request_error"}}')

    def token(self, seq: Sequence) -> None:
        if seq.stream:
            event = orjson.dumps({"id": f"k{seq.request_id}", "object": "chat.completion.chunk", "model": "knee",
                                  "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]})
            out = _chunk(b"data: " + event + b"\n\n")
            if seq.remaining == 0:
                usage = orjson.dumps({"id": f"k{seq.request_id}", "object": "chat.completion.chunk", "model": "knee",
                                      "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 8, "completion_tokens": seq.emitted,
                                                "total_tokens": 8 + seq.emitted}})
                out += _chunk(b"data: " + usage + b"\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            self.transport.write(out)
        elif seq.remaining == 0:
            self._respond(200, orjson.dumps({
                "id": f"k{seq.request_id}", "object": "chat.completion", "model": "knee",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok" * seq.emitted},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": seq.emitted, "total_tokens": 8 + seq.emitted}}))


async def serve(port: int, knee: int, step_ms: float, max_running: int, tokens: int) -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(knee, step_ms / 1000.0, max_running, tokens)
    server = await loop.create_server(lambda: Connection(engine), "127.0.0.1", port, backlog=4096)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner = loop.create_task(engine.run())
    await stop.wait()
    runner.cancel()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--knee", type=int, default=4, help="running sequences at which steps start to slow")
    parser.add_argument("--step-ms", type=float, default=25.0, help="decode step time up to the knee")
    parser.add_argument("--max-running", type=int, default=64, help="the engine's own batch cap; beyond: waiting")
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per answer")
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.knee, args.step_ms, args.max_running, args.tokens))


if __name__ == "__main__":
    main()
