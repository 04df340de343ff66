"""Start-up and shutdown of a real `tidegate engine` process: 503 until loaded, SIGTERM drains."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.support import free_port, start_process, tidegate_argv

pytestmark = pytest.mark.slow
MODEL = "tiny-random-llama"


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None  # not listening (yet, or any more)


def test_health_is_503_while_loading_then_200_and_sigterm_drains_in_flight_stream() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start_process(tidegate_argv("engine", "--model", MODEL, "--port", str(port), "--threads", "2"))
    try:
        seen: list[int] = []
        deadline = time.monotonic() + 120
        while 200 not in seen and time.monotonic() < deadline:
            status = _status(base + "/health")
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            time.sleep(0.05)
        assert seen == [503, 200]
        # fault injection is off unless asked for: a production engine cannot be slowed from outside
        request = urllib.request.Request(base + "/admin/slow", data=b"2", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 404

        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = iter(client.completions.create(model=MODEL, prompt="drain me", max_tokens=80, stream=True,
                                                extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        process.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert _status(base + "/health") == 503  # draining: no new work
        rest = threading.Thread(target=lambda: chunks.extend(stream))
        rest.start()
        rest.join(60)
        assert len(chunks) == 80 and chunks[-1].choices[0].finish_reason == "length"
        assert process.popen.wait(timeout=30) == 0
    finally:
        process.stop()
