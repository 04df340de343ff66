"""The OpenAI Batch API on `tidegate serve` over mock upstreams and a real `redis-server` (AOF on).

The official `openai` client drives files and batches unmodified; tenants see only their own; a bad
input file is refused with the lines at fault. Then the durable queue: an entry a dead consumer held
is taken over, a request run twice leaves one result line, a request that keeps failing goes to the
dead-letter stream and the error file, a batch past its window reports what finished, a cancelled
one keeps what ran.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402
from batch_fixtures import KEY_A, KEY_B, mock_upstream, redis_url, started  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="module")
def mocks(started: list[ManagedProcess]) -> dict[str, str]:
    return {"fast": mock_upstream(started), "slow": mock_upstream(started, "--ttft-ms", "400"),
            "broken": mock_upstream(started, "--error-rate", "1")}


@pytest.fixture(scope="module")
def gateway_factory(started: list[ManagedProcess], mocks: dict[str, str], redis_url: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[str, ManagedProcess]]:
    def start(server: dict | None = None, **batch: object) -> tuple[str, ManagedProcess]:
        port = free_port()
        config = {
            "server": {"port": port, "access_log": False, **(server or {})},
            "health": {"failure_threshold": 1000, "failure_ratio": 1.0},
            "pools": [{"name": name, "backends": [{"type": "upstream", "url": url, "slot_limit": 4}]}
                      for name, url in mocks.items()],
            "tenants": {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
            "batch": {"redis_url": redis_url, "claim_idle_s": 1.0, "sweep_interval_s": 0.2, **batch},
        }
        path = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        process = start_process(tidegate_argv("serve", "--config", str(path)),
                                ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30)
        started.append(process)
        return f"http://127.0.0.1:{port}", process

    return start


@pytest.fixture(scope="module")
def gateway(gateway_factory: Callable[..., tuple[str, ManagedProcess]]) -> str:
    return gateway_factory()[0]


def _client(base: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10)


def _jsonl(count: int, model: str = "fast", url: str = "/v1/chat/completions", prefix: str = "req") -> bytes:
    lines = []
    for i in range(count):
        body: dict = {"model": model, "max_tokens": 4}
        if url == "/v1/embeddings":
            body["input"] = f"text {i}"
        else:
            body["messages"] = [{"role": "user", "content": f"question {i}"}]
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not final after {timeout_s}s: {batch.status} {batch.request_counts}")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def _run_batch(client: openai.OpenAI, content: bytes, window: str = "24h", endpoint: str = "/v1/chat/completions"):
    uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window)


def test_the_openai_client_runs_a_batch_and_reads_its_results(gateway: str) -> None:
    client = _client(gateway)
    uploaded = client.files.create(file=("input.jsonl", _jsonl(20)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(20))
    assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
    assert client.files.content(uploaded.id).content == _jsonl(20)
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"job": "nightly"})
    assert created.status in ("validating", "in_progress") and created.metadata == {"job": "nightly"}
    batch = _wait_final(client, created.id)
    assert batch.status == "completed" and batch.request_counts.total == 20
    assert (batch.request_counts.completed, batch.request_counts.failed) == (20, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    lines = _lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(20)]  # once each, in order
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    assert lines[0]["response"]["body"]["object"] == "chat.completion"


def test_embeddings_batches_run_too(gateway: str) -> None:
    client = _client(gateway)
    batch = _wait_final(client, _run_batch(client, _jsonl(3, url="/v1/embeddings"), endpoint="/v1/embeddings").id)
    assert batch.status == "completed"
    assert _lines(client, batch.output_file_id)[0]["response"]["body"]["object"] == "list"


def test_batches_list_pages_newest_first(gateway: str) -> None:
    client = _client(gateway, KEY_B)
    ids = [_run_batch(client, _jsonl(1)).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more


def test_a_tenant_sees_only_its_own_files_and_batches(gateway: str) -> None:
    owner, other = _client(gateway, KEY_A), _client(gateway, KEY_B)
    batch = _run_batch(owner, _jsonl(1))
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # nor may it make a batch of another tenant's file
        other.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert batch.id not in {b.id for b in other.batches.list(limit=100).data}
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "sk-nobody").batches.list()


@pytest.mark.parametrize(("content", "wanted"), [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "fast"}}\nnot json\n',
     "line 2: not valid JSON"),
    (_jsonl(2, prefix="same").replace(b"same-1", b"same-0"), "line 2: custom_id 'same-0' is repeated"),
    (_jsonl(1, model="gpt-unknown"), "line 1: body.model 'gpt-unknown' is not a model this gateway serves"),
    (_jsonl(1).replace(b'"POST"', b'"GET"'), "line 1: method must be POST"),
    (_jsonl(1, url="/v1/images"), "line 1: url must be one of"),
    (b"\n\n", "holds no request"),
])
def test_an_invalid_input_file_is_refused_with_the_lines_at_fault(gateway: str, content: bytes, wanted: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway).files.create(file=("bad.jsonl", content), purpose="batch")
    assert wanted in refused.value.body["message"] and refused.value.body["param"] == "file"


def test_a_batch_whose_lines_call_another_endpoint_fails_validation(gateway: str) -> None:
    client = _client(gateway)
    batch = _run_batch(client, _jsonl(2), endpoint="/v1/embeddings")
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0].code == "mismatched_endpoint" and batch.errors.data[0].line == 1


def test_bad_batch_requests_get_openai_errors(gateway: str) -> None:
    client = _client(gateway)
    uploaded = client.files.create(file=("in.jsonl", _jsonl(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="48h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", _jsonl(1)), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_a_cancelled_batch_keeps_what_ran_and_runs_no_more(gateway: str) -> None:
    client = _client(gateway)
    created = _run_batch(client, _jsonl(40, model="slow"))
    time.sleep(0.6)  # a few are running (16 at most at once, 0.4 s each)
    assert client.batches.cancel(created.id).status == "cancelling"
    batch = _wait_final(client, created.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    done = _lines(client, batch.output_file_id)
    assert len(done) == batch.request_counts.completed < 40
    assert len({line["custom_id"] for line in done}) == len(done)


def test_a_batch_past_its_window_reports_what_finished(gateway: str) -> None:
    client = _client(gateway)
    batch = _wait_final(client, _run_batch(client, _jsonl(60, model="slow"), window="2s").id)
    assert batch.status == "expired" and batch.expired_at
    counts = batch.request_counts
    finished, expired = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    assert 0 < len(finished) == counts.completed and len(expired) == counts.failed and counts.total == 60
    assert {line["error"]["code"] for line in expired} == {"batch_expired"}
    assert {line["custom_id"] for line in finished} | {line["custom_id"] for line in expired} == \
        {f"req-{i}" for i in range(60)}


def test_a_request_that_keeps_failing_is_dead_lettered_into_the_error_file(
        gateway_factory: Callable[..., tuple[str, ManagedProcess]], redis_url: str) -> None:
    base, _ = gateway_factory(key_prefix="dead:", max_attempts=2, claim_idle_s=0.3)
    client = _client(base)
    batch = _wait_final(client, _run_batch(client, _jsonl(2, model="broken")).id)
    assert batch.status == "completed" and batch.output_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 2)
    errors = _lines(client, batch.error_file_id)
    assert {line["error"]["code"] for line in errors} == {"max_attempts_exceeded"}
    assert "failed after 2 attempts: status 500" in errors[0]["error"]["message"]
    dead = redis.Redis.from_url(redis_url).xrange("dead:dead")
    assert sorted(fields[b"c"] for _, fields in dead) == [b"req-0", b"req-1"]


def _created_without_worker(gateway_factory: Callable[..., tuple[str, ManagedProcess]], prefix: str,
                            count: int) -> tuple[openai.OpenAI, str, ManagedProcess]:
    """A batch queued by a gateway that runs no batch work: its entries wait on the stream."""
    base, process = gateway_factory(key_prefix=prefix, worker=False)
    client = _client(base)
    return client, _run_batch(client, _jsonl(count)).id, process


def test_an_entry_a_dead_consumer_held_is_taken_over(
        gateway_factory: Callable[..., tuple[str, ManagedProcess]], redis_url: str) -> None:
    client, batch_id, _ = _created_without_worker(gateway_factory, "stall:", 5)
    store = redis.Redis.from_url(redis_url)
    # a consumer reads every entry, then dies without acknowledging any
    read = store.xreadgroup("workers", "dead-gateway", {"stall:queue": ">"}, count=10)
    assert len(read[0][1]) == 5 and store.xpending("stall:queue", "workers")["pending"] == 5
    gateway_factory(key_prefix="stall:", claim_idle_s=1.0)
    batch = _wait_final(client, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 5
    assert store.xpending("stall:queue", "workers")["pending"] == 0


def test_a_request_run_twice_leaves_one_result_line(
        gateway_factory: Callable[..., tuple[str, ManagedProcess]], redis_url: str, mocks: dict[str, str]) -> None:
    client, batch_id, _ = _created_without_worker(gateway_factory, "twice:", 6)
    store = redis.Redis.from_url(redis_url)
    for _, fields in store.xrange("twice:queue"):  # every request queued twice, as a redelivery would
        store.xadd("twice:queue", fields)
    served_before = _mock_requests(mocks["fast"])
    # both copies of each request read at once (no background share: 12 in flight over the 4 slots),
    # so each runs twice before either records its result
    base, _ = gateway_factory(key_prefix="twice:", max_in_flight=12, share_memory_s=0)
    batch = _wait_final(client, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 6
    lines = _lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(6))
    assert _mock_requests(mocks["fast"]) - served_before > 6  # some of them did run twice


def _mock_requests(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("mock_api_requests_total"):
                return int(float(line.split()[1]))
    raise AssertionError("no mock_api_requests_total")


def test_the_routes_answer_wrong_methods_and_raw_uploads_clearly(gateway: str) -> None:
    host, port = gateway.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("DELETE", "/v1/batches", headers={"authorization": f"Bearer {KEY_A}"})
    response = connection.getresponse()
    assert response.status == 405 and json.loads(response.read())["error"]["type"]
    connection.request("POST", "/v1/files", body=b'{"not": "multipart"}',
                       headers={"authorization": f"Bearer {KEY_A}", "content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 400 and "multipart/form-data" in json.loads(response.read())["error"]["message"]


def test_a_path_that_only_begins_like_a_batch_route_is_not_found(gateway: str) -> None:
    request = urllib.request.Request(f"{gateway}/v1/filesystem", headers={"authorization": f"Bearer {KEY_A}"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=5)
    assert answer.value.code == 404


def test_a_draining_gateway_hands_its_runs_to_another_at_once_without_counting_them(
        gateway_factory: Callable[..., tuple[str, ManagedProcess]]) -> None:
    # a minute before anything is taken over from a dead consumer, one attempt each, and a drain
    # that waits for nothing: the batch completes only if the drained gateway's runs are handed
    # back, idle, and not counted
    settings = {"key_prefix": "drain:", "claim_idle_s": 60.0, "max_attempts": 1, "max_in_flight": 4}
    first, first_process = gateway_factory(server={"drain_timeout_s": 0}, **settings)
    gateway_factory(**settings)
    client = _client(first)
    created = _run_batch(client, _jsonl(40, model="slow"))
    time.sleep(0.6)
    assert first_process.stop() == 0  # SIGTERM: drains
    batch = _wait_final(_client(gateway_factory(**{**settings, "worker": False})[0]), created.id, timeout_s=40)
    assert batch.status == "completed" and batch.request_counts.completed == 40
