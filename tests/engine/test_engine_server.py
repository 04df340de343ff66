"""The official openai client against a real `tidegate engine` process serving tiny-random-llama."""

from __future__ import annotations

from collections.abc import Iterator

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.support import ManagedProcess, free_port, start_process, tidegate_argv

pytestmark = pytest.mark.slow
MODEL = "tiny-random-llama"


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    argv = tidegate_argv("engine", "--model", MODEL, "--port", str(port), "--threads", "2", "--kv-cache-tokens", "8192",
                         "--fault-injection")
    process: ManagedProcess = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=120)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(engine: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_preset_and_says_its_text_is_meaningless(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and "meaningless" in model.model_extra["description"]


def test_chat_completion_reports_length_and_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_completion_returns_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 3


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client: openai.OpenAI) -> None:
    system = "You answer questions about tide gates and their maintenance. " * 12  # many full blocks

    def ask(question: str) -> openai.types.CompletionUsage:
        return client.chat.completions.create(
            model=MODEL, max_tokens=2, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}]).usage

    first, second = ask("When are they checked?"), ask("Who repairs them?")
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.prompt_tokens  # whole blocks of the shared system prompt


def test_streaming_chat_ends_with_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_streaming_completion_sends_one_chunk_per_token(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len(chunks) == 6 and chunks[-1].choices[0].finish_reason == "length"


def test_same_seed_gives_same_text(client: openai.OpenAI) -> None:
    def sample() -> str:
        return client.completions.create(model=MODEL, prompt="seeded", max_tokens=12, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample() == sample()


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[3:5]
    reply = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == greedy[: greedy.index(stop)]


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": "no-such-model", "prompt": "x"}, 404),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": 100_000}, 400),
        ({"model": MODEL, "prompt": ""}, 400),
        ({"model": MODEL, "prompt": "x" * 9000}, 400),
    ],
)
def test_bad_request_gets_openai_error_and_engine_keeps_serving(
    client: openai.OpenAI, body: dict, status: int
) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(**body)
    assert raised.value.status_code == status and raised.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=1).choices


def test_invalid_json_is_a_400(engine: str) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(engine + "/v1/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    assert raised.value.code == 400


def test_metrics_expose_the_names_the_gateway_reads(engine: str) -> None:
    import urllib.request

    text = urllib.request.urlopen(engine + "/metrics", timeout=10).read().decode()
    for name in ("tidegate_engine_running_sequences", "tidegate_engine_waiting_sequences",
                 "tidegate_engine_kv_cache_usage", "tidegate_engine_ttft_seconds_bucket",
                 "tidegate_engine_generation_tokens_total", "tidegate_engine_step_batch_size_bucket"):
        assert name in text


def _metric(engine: str, name: str) -> float:
    import urllib.request

    for line in urllib.request.urlopen(engine + "/metrics", timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


def test_client_disconnect_frees_its_sequence(client: openai.OpenAI, engine: str) -> None:
    import time

    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=3000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert _metric(engine, "tidegate_engine_running_sequences") == 1
    stream.close()
    deadline = time.monotonic() + 10
    while _metric(engine, "tidegate_engine_running_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(engine, "tidegate_engine_running_sequences") == 0


def _post(url: str, body: bytes) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_fault_injection_slows_the_engine_and_rejects_a_bad_factor(engine: str, client: openai.OpenAI) -> None:
    assert _post(engine + "/admin/slow", b"2.5") == (200, {"slowdown": 2.5})
    try:
        reply = client.completions.create(model=MODEL, prompt="slow", max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3  # slower, still serving
    finally:
        assert _post(engine + "/admin/slow", b"1")[0] == 200
    for bad in (b"0.5", b"fast", b""):
        status, body = _post(engine + "/admin/slow", bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
