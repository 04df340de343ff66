"""`tidegate engine --model all-MiniLM-L6-v2` serves embeddings only, through the same server."""

from __future__ import annotations

import openai
import pytest

from tests.support import free_port, start_process, tidegate_argv

pytestmark = pytest.mark.slow
MODEL = "all-MiniLM-L6-v2"


def test_embedding_model_serves_embeddings_and_refuses_generation() -> None:
    port = free_port()
    argv = tidegate_argv("engine", "--model", MODEL, "--port", str(port), "--threads", "2")
    process = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=120,
                            env={"HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        result = client.embeddings.create(model=MODEL, input=["the tide", "a ship"])
        assert len(result.data) == 2 and len(result.data[0].embedding) == 384
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    finally:
        process.stop()
