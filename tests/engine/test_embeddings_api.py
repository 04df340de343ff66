"""POST /v1/embeddings through aiohttp's test client, over a fake model: schema, errors, base64."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.engine.test_embeddings_batcher import FakeEmbeddingModel
from tidegate.engine.embeddings import EmbeddingBatcher
from tidegate.engine.embeddings_api import MAX_INPUTS, decode_base64, encode_base64, make_embeddings_routes

SERVED = "served-embedder"


@pytest.fixture
async def client():
    batcher = EmbeddingBatcher(FakeEmbeddingModel(), max_batch_size=8, max_queue_delay_ms=1.0)
    await batcher.start()
    app = web.Application(client_max_size=64 * 1024)
    app.add_routes(make_embeddings_routes(batcher, SERVED))
    async with TestClient(TestServer(app)) as test_client:
        yield test_client
    await batcher.close()


async def post(client: TestClient, body: object) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    response = await client.post("/v1/embeddings", data=raw, headers={"Content-Type": "application/json"})
    return response.status, await response.json()


async def test_string_input_returns_one_embedding(client) -> None:
    status, body = await post(client, {"model": SERVED, "input": "hello world"})
    assert status == 200
    assert body["object"] == "list" and body["model"] == SERVED
    assert [item["index"] for item in body["data"]] == [0]
    assert body["data"][0]["embedding"] == pytest.approx(FakeEmbeddingModel.vector("hello world").tolist())


async def test_list_input_keeps_order(client) -> None:
    texts = ["a", "bb bb", "ccc ccc ccc"]
    _status, body = await post(client, {"model": SERVED, "input": texts})
    got = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, np.stack([FakeEmbeddingModel.vector(t) for t in texts]))


async def test_usage_counts_prompt_tokens(client) -> None:
    _status, body = await post(client, {"model": SERVED, "input": ["a", "b c"]})
    assert body["usage"] == {"prompt_tokens": 3 + 4, "total_tokens": 3 + 4}


async def test_base64_is_little_endian_float32(client) -> None:
    _status, body = await post(client, {"model": SERVED, "input": "x y", "encoding_format": "base64"})
    decoded = decode_base64(body["data"][0]["embedding"])
    assert decoded.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(decoded, FakeEmbeddingModel.vector("x y"))


def test_base64_round_trip_is_exact() -> None:
    vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    np.testing.assert_array_equal(decode_base64(encode_base64(vector)), vector)


async def test_model_name_of_the_loaded_model_is_accepted(client) -> None:
    status, _body = await post(client, {"model": FakeEmbeddingModel.name, "input": "x"})
    assert status == 200


async def test_matching_dimensions_is_accepted(client) -> None:
    status, _body = await post(client, {"model": SERVED, "input": "x", "dimensions": 4})
    assert status == 200


async def test_user_is_ignored(client) -> None:
    status, _body = await post(client, {"model": SERVED, "input": "x", "user": "someone"})
    assert status == 200


async def test_null_options_are_not_set(client) -> None:
    # OpenAI's spec makes them nullable, and clients send the options they leave unset so
    status, body = await post(client, {"model": SERVED, "input": "x", "encoding_format": None, "dimensions": None,
                                       "user": None})
    assert status == 200 and isinstance(body["data"][0]["embedding"], list)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": SERVED}, "input"),
        ({"model": SERVED, "input": ""}, "input"),
        ({"model": SERVED, "input": []}, "input"),
        ({"model": SERVED, "input": ["ok", ""]}, "input"),
        ({"model": SERVED, "input": 42}, "input"),
        ({"model": SERVED, "input": ["ok", 3.5]}, "input"),
        ({"model": SERVED, "input": [1, 2, 3]}, "input"),
        ({"model": SERVED, "input": [[1, 2], [3]]}, "input"),
        ({"model": SERVED, "input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": "x"}, "model"),
        ({"model": 7, "input": "x"}, "model"),
        ({"model": SERVED, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": SERVED, "input": "x", "dimensions": 2}, "dimensions"),
        ({"model": SERVED, "input": "x", "dimensions": True}, "dimensions"),
        ({"model": SERVED, "input": "x", "user": 5}, "user"),
    ],
)
async def test_bad_field_is_a_400_naming_it(client, body: dict, param: str) -> None:
    status, error = await post(client, body)
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
async def test_body_that_is_not_a_json_object_is_a_400(client, raw: bytes) -> None:
    status, error = await post(client, raw)
    assert status == 400 and error["error"]["type"] == "invalid_request_error"


async def test_unknown_model_is_a_404(client) -> None:
    status, error = await post(client, {"model": "gpt-4o", "input": "x"})
    assert status == 404 and error["error"]["code"] == "model_not_found"


async def test_oversized_body_is_a_413(client) -> None:
    status, error = await post(client, {"model": SERVED, "input": "x" * 100_000})
    assert status == 413 and "error" in error


async def test_still_serving_after_bad_requests(client) -> None:
    await post(client, b"{not json")
    await post(client, {"model": SERVED, "input": ""})
    status, _body = await post(client, {"model": SERVED, "input": "still here"})
    assert status == 200
