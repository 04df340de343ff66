"""JSON logs: a logging formatter for events, and a buffered access log that costs ~1 µs a request."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "configure_logging", "AccessLog"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("tidegate")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class AccessLog:
    """One compact JSON line per request, written in batches so the hot path never blocks on stderr."""

    def __init__(self, enabled: bool, fd: int | None = None, flush_interval_s: float = 0.2) -> None:
        self.enabled = enabled
        self._fd = sys.stderr.fileno() if fd is None else fd
        self._lines: list[bytes] = []
        self._size = 0
        self._flush_interval_s = flush_interval_s
        self._task: asyncio.Task[None] | None = None

    def record(self, request_id: bytes, method: bytes, path: bytes, model: str | None, status: int,
               duration_s: float, replica: str | None, trace_id: int | None = None) -> None:
        """`trace_id`: the W3C trace the request belongs to (traced, or a client's passed on), so that a
        line leads to its spans."""
        if not self.enabled:
            return
        entry = {
            "ts": round(time.time(), 3), "type": "access", "request_id": request_id.decode("latin-1"),
            "method": method.decode("latin-1"), "path": path.decode("latin-1"), "model": model,
            "status": status, "duration_ms": round(duration_s * 1000.0, 3), "replica": replica,
        }
        if trace_id is not None:
            entry["trace_id"] = "%032x" % trace_id
        line = orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
        self._lines.append(line)
        self._size += len(line)
        if self._size > 65536:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            data = b"".join(self._lines)
            self._lines, self._size = [], 0
            try:
                os.write(self._fd, data)
            except OSError:
                pass

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    async def _flush_periodically(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._flush_interval_s)
                self.flush()
        finally:
            self.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.flush()
