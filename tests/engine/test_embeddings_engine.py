"""The official `openai` client against a real `tidegate engine --model all-MiniLM-L6-v2` process."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.support import free_port, start_process, tidegate_argv

MODEL = "all-MiniLM-L6-v2"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    port = free_port()
    process = start_process(
        tidegate_argv("engine", "--model", MODEL, "--port", str(port), "--threads", "2"),
        ready_url=f"http://127.0.0.1:{port}/health",
        timeout_s=90,
    )
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    finally:
        process.stop()


def vectors(response) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def test_string_input_gives_one_unit_vector(client) -> None:
    response = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert vectors(response).shape == (1, 384)
    assert np.linalg.norm(vectors(response)[0]) == pytest.approx(1.0, abs=1e-4)
    assert response.usage.prompt_tokens == response.usage.total_tokens == 4


def test_list_input_keeps_order(client) -> None:
    texts = ["a cat sat on the mat", "stock markets fell", "a kitten sat on a rug"]
    got = vectors(client.embeddings.create(model=MODEL, input=texts, encoding_format="float"))
    assert got.shape == (3, 384)
    assert got[0] @ got[2] > got[0] @ got[1]  # the cat is nearer the kitten than the stock market


def test_base64_matches_float(client) -> None:
    texts = ["base64 carries the same floats", "second input"]
    floats = vectors(client.embeddings.create(model=MODEL, input=texts, encoding_format="float"))
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") for item in raw.data])
    np.testing.assert_allclose(decoded, floats, atol=1e-6)


def test_client_default_encoding_decodes(client) -> None:
    """Without encoding_format the client asks for base64 and decodes it itself."""
    response = client.embeddings.create(model=MODEL, input="decoded by the client")
    assert len(response.data[0].embedding) == 384


def test_empty_input_is_a_bad_request_and_the_engine_keeps_serving(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")
    assert client.embeddings.create(model=MODEL, input="still serving").data


def test_unknown_model_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
