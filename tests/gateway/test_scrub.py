"""SecretScrubber on its own: every form of the key found and replaced, everything else left as it came."""

from __future__ import annotations

import base64
import json
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leaky_upstream import escape_dashes, escape_every_char, percent_every_byte
from tidegate.gateway.scrub import SecretScrubber, StreamScrubber, safe_content_type

KEY = "sk-proj-Abc123/def+456_ghiJKL789"  # punctuation JSON and URL encoders escape: `/` and `+`
SCRUBBER = SecretScrubber(KEY)


def _error(text: str) -> bytes:
    """An error body whose message holds `text` verbatim: `text` is already JSON string content."""
    return b'{"error":{"message":"bad key: ' + text.encode() + b'","type":"invalid_request_error"}}'


FORMS = {
    "raw": KEY,
    "json dashes": escape_dashes(KEY),
    "json every char": escape_every_char(KEY),
    "json every char lower hex": escape_every_char(KEY).lower(),
    "json slash": KEY.replace("/", "\\/"),
    "json twice": json.dumps('{"k": "%s"}' % escape_dashes(KEY))[1:-1],  # a JSON text quoted in a string
    "percent": urllib.parse.quote(f"Bearer {KEY}", safe=""),
    "percent every byte": percent_every_byte(KEY),
    "base64 key": base64.b64encode(KEY.encode()).decode(),
    "base64 bearer": base64.b64encode(f"Bearer {KEY}".encode()).decode(),
    "base64 basic": base64.b64encode(f"user:{KEY}".encode()).decode().replace("/", "\\/"),
    "base64url basic": base64.urlsafe_b64encode(f"ab:{KEY}".encode()).decode(),
}


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_every_form_is_scrubbed_from_an_error_and_it_stays_json(form: str) -> None:
    body = _error(form)
    scrubbed = SCRUBBER.scrub_answer(401, body)
    assert scrubbed != body
    assert not SCRUBBER.found(scrubbed, thorough=True)
    error = json.loads(scrubbed)["error"]
    assert "***" in error["message"] and error["type"] == "invalid_request_error"
    assert "Abc123" not in error["message"] and "ghiJKL789" not in error["message"]


@pytest.mark.parametrize("form", ["raw", "json dashes", "json slash", "percent"])
def test_forms_that_keep_letters_and_digits_are_scrubbed_from_200_answers(form: str) -> None:
    body = b'{"choices":[{"message":{"content":"echo: ' + FORMS[form].encode() + b'"}}]}'
    scrubbed = SCRUBBER.scrub_answer(200, body)
    assert "ghiJKL789" not in json.loads(scrubbed)["choices"][0]["message"]["content"]


def test_an_answer_without_the_key_is_the_same_object() -> None:
    body = json.dumps({"choices": [{"message": {"content": "caf\u00e9 50% \\n done"}}]}, ensure_ascii=True).encode()
    assert SCRUBBER.scrub_answer(200, body) is body
    assert SCRUBBER.scrub_answer(500, body) is body


def test_a_piece_of_the_key_alone_is_left_alone() -> None:
    body = b'{"content":"ghiJKL789 is a fine word"}'  # the key's longest run, not the key
    assert SCRUBBER.scrub_answer(200, body) is body


def test_non_json_error_is_scrubbed_bytewise() -> None:
    body = f"<html>upstream said {escape_every_char(KEY)} and {KEY}</html>".encode()
    assert SCRUBBER.scrub_answer(502, body) == b"<html>upstream said *** and ***</html>"


def test_placeholder_key_is_scrubbed_from_errors_only() -> None:
    placeholder = SecretScrubber("EMPTY")
    assert not placeholder.in_success_answers
    assert placeholder.scrub_answer(200, b'{"content":"the list is EMPTY"}') == b'{"content":"the list is EMPTY"}'
    assert placeholder.scrub_answer(401, b'{"error":{"message":"key EMPTY"}}') == b'{"error":{"message":"key ***"}}'


def test_stream_scrubs_a_key_split_across_reads_and_holds_partial_lines() -> None:
    stream = StreamScrubber(SCRUBBER)
    event = b'data: {"error":{"message":"key ' + escape_dashes(KEY).encode() + b'"}}\n\n'
    out: list[bytes] = []
    for start in range(0, len(event), 5):
        stream.pieces.append(event[start:start + 5])
        stream.drain(out)
        assert all(piece.endswith(b"\n") for piece in out)  # only whole lines pass
    assert json.loads(b"".join(out)[len(b"data: "):]) == {"error": {"message": "key ***"}}


def test_stream_passes_on_the_last_line_at_the_end() -> None:
    stream = StreamScrubber(SCRUBBER)
    out: list[bytes] = []
    stream.pieces.append(b"data: [DONE]")
    stream.drain(out)
    assert out == []
    stream.drain(out, at_end=True)
    assert out == [b"data: [DONE]"]


@pytest.mark.parametrize("value, expected", [
    (b"application/json", b"application/json"),
    (b"text/event-stream; charset=utf-8", b"text/event-stream; charset=utf-8"),
    (b"application/problem+json", b"application/problem+json"),
    (b'Application/JSON;charset="UTF-8"', b'Application/JSON;charset="UTF-8"'),
    (b"text/html", b"DEFAULT"),
    (b"application/json; auth=Bearer " + KEY.encode(), b"DEFAULT"),
    (b"application/json; charset=x\r\nset-cookie: a=b", b"DEFAULT"),
    (b"application/json; charset=sk-proj-Abc123", b"application/json; charset=sk-proj-Abc123"),  # not the key
])
def test_content_type_is_a_plain_media_type_or_the_default(value: bytes, expected: bytes) -> None:
    assert safe_content_type(value, b"DEFAULT", SCRUBBER) == expected


def test_content_type_that_is_the_key_is_replaced() -> None:
    short = SecretScrubber("utf-8-key-12345")
    assert safe_content_type(b"text/plain; charset=utf-8-key-12345", b"DEFAULT", short) == b"DEFAULT"


@settings(max_examples=150, deadline=None)
@given(before=st.text(max_size=40), after=st.text(max_size=40), escape=st.sets(st.sampled_from(sorted(set(KEY)))))
def test_key_with_any_characters_escaped_never_survives(before: str, after: str, escape: set[str]) -> None:
    escaped = "".join(f"\\u{ord(char):04x}" if char in escape else char for char in KEY)
    body = b'{"error":{"message":' + json.dumps(before).encode()[:-1] + escaped.encode() \
        + json.dumps(after).encode()[1:] + b"}}"
    message = json.loads(SCRUBBER.scrub_answer(400, body))["error"]["message"]
    assert KEY not in message and "***" in message
