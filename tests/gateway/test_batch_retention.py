"""Retention of the Batch API's state in a real redis-server (short retention in the test config):
finished batches and their files go and leave no keys behind, a file an unfinished batch reads
outlives its retention, the dead-letter stream is trimmed, and idle consumers with nothing pending
are removed while one holding entries is kept."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_fixtures import client, gateway_factory, jsonl, mocks, redis_url, started, wait_final  # noqa: E402,F401

SHORT = {"retention_s": 1.0, "retention_sweep_interval_s": 0.3}


def _gone(fetch, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            fetch()
        except openai.NotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_a_finished_batch_and_its_files_expire_and_leave_no_keys(gateway_factory, redis_url: str) -> None:
    # kept 3 s, not 1: the test must see the batch completed before it expires, and on two loaded
    # cores one status poll has taken over a second
    api = client(gateway_factory(key_prefix="ret:", **{**SHORT, "retention_s": 3.0}))
    unused = api.files.create(file=("unused.jsonl", jsonl(1)), purpose="batch")
    uploaded = api.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    batch = wait_final(api, api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert batch.status == "completed" and batch.output_file_id
    assert _gone(lambda: api.batches.retrieve(batch.id))
    for file_id in (unused.id, uploaded.id, batch.output_file_id):
        assert _gone(lambda: api.files.retrieve(file_id))
    assert api.batches.list().data == [] and api.files.list().data == []
    left = {key.decode() for key in redis.Redis.from_url(redis_url).keys("ret:*")}
    assert left <= {"ret:seq", "ret:queue"}, left  # the counter and the (empty) stream


def test_a_file_a_running_batch_reads_outlives_its_retention(gateway_factory) -> None:
    api = client(gateway_factory(key_prefix="long:", max_in_flight=1, **SHORT))
    uploaded = api.files.create(file=("in.jsonl", jsonl(12, model="slow")), purpose="batch")
    created = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    time.sleep(2.5)  # past the retention, still running (12 x 0.3 s one at a time)
    assert api.batches.retrieve(created.id).status == "in_progress"
    assert api.files.retrieve(uploaded.id).id == uploaded.id
    batch = wait_final(api, created.id)
    # the finalizer read the input's custom_ids: every result line is in the output file
    assert batch.status == "completed" and batch.request_counts.completed == 12
    assert len(api.files.content(batch.output_file_id).content.splitlines()) == 12


def test_the_dead_letter_stream_is_trimmed(gateway_factory, redis_url: str) -> None:
    api = client(gateway_factory(key_prefix="trim:", max_attempts=1, claim_idle_s=0.3, dead_letter_max_len=2))
    uploaded = api.files.create(file=("in.jsonl", jsonl(5, model="broken")), purpose="batch")
    batch = wait_final(api, api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert batch.request_counts.failed == 5  # every error line is kept in the error file
    assert redis.Redis.from_url(redis_url).xlen("trim:dead") == 2


def test_idle_consumers_with_nothing_pending_are_removed(gateway_factory, redis_url: str) -> None:
    store = redis.Redis.from_url(redis_url)
    store.xgroup_create("idle:queue", "workers", id="0", mkstream=True)
    fields = {"b": "batch_none", "c": "x", "u": "/v1/chat/completions", "j": "{}"}
    for consumer in ("gone-idle", "gone-holding"):  # each reads an entry; the first acknowledges it
        store.xadd("idle:queue", fields)
        store.xreadgroup("workers", consumer, {"idle:queue": ">"}, count=1)
    store.xack("idle:queue", "workers", store.xpending_range("idle:queue", "workers", "-", "+", 10,
                                                            consumername="gone-idle")[0]["message_id"])
    assert _consumers(store) == {"gone-idle", "gone-holding"}
    # finished batches kept 600 s: retention is not this test's subject, and a batch that expired
    # between finishing and the next status poll on two loaded cores read as lost (404)
    base = gateway_factory(key_prefix="idle:", consumer_idle_s=2.5, claim_idle_s=600,
                           **{**SHORT, "retention_s": 600.0})
    deadline = time.monotonic() + 15
    while "gone-idle" in _consumers(store) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _consumers(store) == {"gone-holding"}  # kept: its entry is pending
    # a live worker's consumer removed while it had nothing pending loses nothing: it comes back
    api = client(base)
    uploaded = api.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    batch = wait_final(api, api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert batch.request_counts.completed == 3
    # every entry the worker read was acknowledged; only the held entry stays pending. (Not a count
    # of consumers: the worker's own consumer is removed again once idle 2.5 s, which a slow poll
    # on loaded cores can outlast.)
    assert store.xpending("idle:queue", "workers")["pending"] == 1


def _consumers(store: redis.Redis) -> set[str]:
    return {c["name"].decode() for c in store.xinfo_consumers("idle:queue", "workers")}
