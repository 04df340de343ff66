"""An upstream that quotes back the Authorization it received, in the ways servers have leaked one.

The first path segment picks the leak, so one server backs a pool per leak: a backend URL
`http://127.0.0.1:<port>/<leak>/v1`. Runs in a thread of the test process (`serve_leaky_upstream`).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LEAKS = ("escaped-error", "plain-error", "content-type", "stream-error-event", "success-echo")


def escape_dashes(text: str) -> str:
    """JSON text for `text` with each `-` as `\\u002d`, as some encoders write it."""
    return json.dumps(text)[1:-1].replace("-", "\\u002d")


def escape_every_char(text: str) -> str:
    """JSON text for `text` with every character a `\\uXXXX` escape, upper-case hex."""
    return "".join(f"\\u{ord(char):04X}" for char in text)


def percent_every_byte(text: str) -> str:
    return "".join(f"%{byte:02x}" for byte in text.encode())


def _chat_chunk(delta: dict, finish: str | None = None) -> bytes:
    chunk = {"id": "leak-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class LeakyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        quoted = self.headers.get("authorization", "")  # "Bearer <key>"
        key = quoted.removeprefix("Bearer ")
        leak = self.path.strip("/").split("/")[0]
        stream = bool(request.get("stream"))
        if leak == "escaped-error":
            basic = base64.b64encode(f"gateway:{key}".encode()).decode().replace("/", "\\/")
            body = ('{"error":{"message":"Incorrect API key provided: %s","type":"invalid_request_error",'
                    '"code":"invalid_api_key","received":"%s","forwarded":"%s","basic":"%s","bearer_b64":"%s"}}'
                    % (escape_dashes(quoted), escape_every_char(key), urllib.parse.quote(quoted, safe=""), basic,
                       base64.b64encode(quoted.encode()).decode()))
            self._send_whole(401, "application/json", body.encode())
        elif leak == "plain-error":
            text = f"upstream crashed handling {quoted} ({percent_every_byte(key)})"
            self._send_whole(500, "text/plain", text.encode())
        elif leak == "content-type":
            # the upstream puts the request's key in the one header the gateway passes on
            if stream:
                self._send_stream(f"text/event-stream; auth={quoted}",
                                  [_chat_chunk({"content": "hi"}), _chat_chunk({}, "stop"), b"data: [DONE]\n\n"])
            else:
                self._send_whole(200, f"application/json; auth={quoted}", self._completion("hi"))
        elif leak == "stream-error-event":
            error = ('data: {"error":{"message":"quota exceeded for key %s","type":"server_error",'
                     '"code":"rate_limited"}}\n\n' % escape_dashes(key)).encode()
            cut = error.index(b"SECRET")  # the key arrives in two reads
            self._send_stream("text/event-stream", [_chat_chunk({"role": "assistant"}), _chat_chunk({"content": "hi"}),
                                                    error[:cut], error[cut:], b"data: [DONE]\n\n"])
        elif leak == "success-echo":
            text = f"you sent {quoted}"
            if stream:
                event = _chat_chunk({"content": text})
                cut = event.index(b"SECRET")
                self._send_stream("text/event-stream", [_chat_chunk({"role": "assistant"}), event[:cut], event[cut:],
                                                        _chat_chunk({}, "stop"), b"data: [DONE]\n\n"])
            else:
                body = self._completion(text).replace(key.encode(), escape_dashes(key).encode(), 1)
                self._send_whole(200, "application/json", body)
        else:
            self._send_whole(404, "application/json", b'{"error":{"message":"no such leak"}}')

    @staticmethod
    def _completion(text: str) -> bytes:
        # the echo twice: once as it came, once (by the caller) JSON-escaped
        return json.dumps({"id": "leak-1", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{text} / {text}"},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).encode()

    def _send_whole(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_stream(self, content_type: str, pieces: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            self.wfile.flush()
            time.sleep(0.02)  # separate reads on the gateway's side
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve_leaky_upstream() -> Iterator[int]:
    """The port of a leaky upstream on loopback, for the `with` block's duration."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), LeakyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
