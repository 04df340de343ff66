"""`GET /v1/files` and `DELETE /v1/files/{id}` with the official `openai` client, over a real
redis-server: OpenAI's list shape and paging, a tenant's own files only, and a file an unfinished
batch reads refused with 409 `file_in_use`, race-free against a batch being created from it."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_fixtures import (KEY_B, client, gateway_factory, jsonl, mocks, redis_url, started,  # noqa: E402,F401
                            wait_final)


def test_files_list_pages_a_tenants_files_newest_first(gateway_factory) -> None:
    base = gateway_factory(key_prefix="list:", worker=False)
    owner, other = client(base), client(base, KEY_B)
    ids = [owner.files.create(file=(f"in-{i}.jsonl", jsonl(1)), purpose="batch").id for i in range(3)]
    other.files.create(file=("theirs.jsonl", jsonl(1)), purpose="batch")
    listed = owner.files.list()
    assert [f.id for f in listed.data] == ids[::-1] and listed.data[0].filename == "in-2.jsonl"
    first = owner.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    rest = owner.files.list(limit=2, after=first.data[-1].id)
    assert [f.id for f in rest.data] == [ids[0]] and not rest.has_more
    assert [f.id for f in owner.files.list(order="asc")] == ids  # the iterator follows has_more/after
    assert [f.id for f in owner.files.list(purpose="batch_output").data] == []
    with pytest.raises(openai.BadRequestError, match="limit"):
        owner.files.list(limit=0)


def test_a_deleted_file_is_gone_and_another_tenant_cannot_delete_it(gateway_factory) -> None:
    base = gateway_factory(key_prefix="delete:", worker=False)
    owner, other = client(base), client(base, KEY_B)
    uploaded = owner.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        other.files.delete(uploaded.id)
    deleted = owner.files.delete(uploaded.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (uploaded.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        owner.files.delete(uploaded.id)
    assert uploaded.id not in {f.id for f in owner.files.list()}


def test_a_file_an_unfinished_batch_reads_is_refused_409_until_the_batch_ends(gateway_factory) -> None:
    base = gateway_factory(key_prefix="inuse:", worker=False)  # nobody runs it: it stays in_progress
    api = client(base)
    uploaded = api.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError) as refused:
        api.files.delete(uploaded.id)
    assert refused.value.status_code == 409 and refused.value.body["code"] == "file_in_use"
    assert batch.id in refused.value.body["message"]
    assert api.files.retrieve(uploaded.id).id == uploaded.id
    api.batches.cancel(batch.id)
    gateway_factory(key_prefix="inuse:")  # a worker's sweep closes the cancelled batch
    assert wait_final(api, batch.id).status == "cancelled"
    assert api.files.delete(uploaded.id).deleted


def test_output_files_are_listed_and_deletable(gateway_factory) -> None:
    base = gateway_factory(key_prefix="outputs:")
    api = client(base)
    uploaded = api.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    batch = wait_final(api, api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert [f.id for f in api.files.list(purpose="batch_output").data] == [batch.output_file_id]
    assert api.files.delete(batch.output_file_id).deleted and api.files.delete(uploaded.id).deleted
    assert api.files.list().data == []


def test_deleting_a_file_while_a_batch_is_created_from_it_never_leaves_a_batch_without_its_file(
        gateway_factory) -> None:
    base = gateway_factory(key_prefix="race:", worker=False)
    api = client(base)
    outcomes = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i in range(20):
            file_id = api.files.create(file=(f"in-{i}.jsonl", jsonl(2)), purpose="batch").id
            create = pool.submit(api.batches.create, input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
            delete = pool.submit(api.files.delete, file_id)
            created = _outcome(create)
            deleted = _outcome(delete)
            outcomes.append((created, deleted))
            if created == "ok":  # the batch holds its file: the delete came after and was refused
                assert deleted == "conflict" and api.batches.retrieve(create.result().id).status == "in_progress"
                assert api.files.retrieve(file_id).id == file_id
            else:  # the delete came first: the batch was refused as the file did not exist
                assert (created, deleted) == ("not_found", "ok")
    assert len(outcomes) == 20


def _outcome(future) -> str:
    try:
        future.result()
        return "ok"
    except openai.ConflictError:
        return "conflict"
    except openai.NotFoundError:
        return "not_found"
