"""`tidegate serve` with no config: real engine workers, chat and embeddings through the gateway."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from support import free_port, start_process, tidegate_argv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    port = free_port()
    process = start_process(tidegate_argv("serve", "--port", str(port)),
                            ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=240)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        process.stop(timeout_s=40)  # the gateway stops its workers, each draining


def test_embedded_chat(client: openai.OpenAI) -> None:
    # random weights may sample end-of-sequence early; ignore_eos (vLLM's field) fixes the length
    reply = client.chat.completions.create(model="tiny-random-llama", max_tokens=4, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 4
    assert reply.choices[0].finish_reason == "length"


def test_embedded_chat_stream(client: openai.OpenAI) -> None:
    # greedy and ignore_eos: random weights sampled at temperature 1 may end the stream before any text
    chunks = list(client.chat.completions.create(model="tiny-random-llama", max_tokens=4, stream=True, temperature=0,
                                                 extra_body={"ignore_eos": True},
                                                 messages=[{"role": "user", "content": "hi"}]))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"


def test_embedded_embeddings(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a sentence", "another"])
    assert [len(item.embedding) for item in reply.data] == [384, 384]


def test_embedded_models(client: openai.OpenAI) -> None:
    assert {model.id for model in client.models.list()} == {"tiny-random-llama", "all-MiniLM-L6-v2"}
