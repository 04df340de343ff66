"""Keeps the gateway's own upstream credentials out of what clients receive.

An upstream that rejects or logs a request may quote its `Authorization` back: raw, JSON-escaped
(`sk\\u002d...`, any hex case, `\\/`), percent-encoded, or base64 (of the key, of `Bearer <key>`,
of a basic-auth `user:key`). A `SecretScrubber` holds, once per replica, patterns for every one of
those forms of its key and replaces what it finds with `***`. Its cost is in the check every
answer pays, so there are two:

- the cheap check (every 200 body and stream read): one `find` of an anchor, the key's longest run
  of letters and digits. JSON and URL encoders escape punctuation, not letters and digits, so the
  anchor is there in the key's raw, JSON-escaped and percent-encoded forms;
- the thorough check (error answers, error events, content-type): the anchors of the base64 forms
  too, and the same finds once more with `\\u00XX` and `%XX` escapes undone, when there are any.

On a hit, a JSON document is decoded, the key replaced in every string that may hold it (object
keys too) with the regex of all its forms, and re-encoded, so the answer stays valid JSON; anything
else gets the same regex on its bytes. Not covered: hex, MIME base64 with line breaks, compression,
a key split across separate JSON strings or SSE lines (see docs/configuration.md).
"""

from __future__ import annotations

import base64
import re

import orjson

__all__ = ["SecretScrubber", "StreamScrubber", "safe_content_type", "MIN_SECRET_CHARS", "REDACTED"]

REDACTED = "***"
_REDACTED_BYTES = REDACTED.encode()
# Shorter keys are placeholders (`EMPTY`, `none`) rather than secrets: starring every such word in
# generated text would damage answers, so they are scrubbed only from error answers and error events.
MIN_SECRET_CHARS = 8

_USUAL_CONTENT_TYPES = {
    b"application/json", b"application/json; charset=utf-8", b"text/event-stream",
    b"text/event-stream; charset=utf-8",
}
# the only upstream header the gateway passes on: a media type of a shape an API answer may have,
# with at most a charset; anything else (a quoted request, a key) becomes the default for the answer
_MEDIA_TYPE = re.compile(
    rb"(?:application/(?:[a-z0-9.-]+\+)?json|application/x-ndjson|text/event-stream|text/plain)"
    rb'(?:[ \t]*;[ \t]*charset[ \t]*=[ \t]*(?:[a-z0-9._-]{1,32}|"[a-z0-9._-]{1,32}"))?', re.IGNORECASE)
_MAX_CONTENT_TYPE_BYTES = 128
_LETTERS_AND_DIGITS = re.compile(rb"[A-Za-z0-9]+")
# a byte as a JSON `\\u00XX` escape, or percent-encoded (also twice): two patterns, as each starts
# with a literal the regex engine scans for fast, where an alternation is tried at every byte
_JSON_ESCAPED_BYTE = re.compile(rb"\\u00([0-9a-fA-F]{2})")
_PERCENT_ENCODED_BYTE = re.compile(rb"%(?:25)*([0-9a-fA-F]{2})")


def _unescape_byte(match: re.Match[bytes]) -> bytes:
    return bytes((int(match[1], 16),))


def _hex_digit(digit: str) -> str:
    return f"[{digit.lower()}{digit.upper()}]" if digit.isalpha() else digit


def _hex(value: int, width: int) -> str:
    return "".join(_hex_digit(digit) for digit in f"{value:0{width}x}")


def _any_form(char: str) -> str:
    """A regex for one character as it may appear once encoded: itself, a JSON `\\uXXXX` escape (any
    hex case, also doubly escaped), a short JSON escape, or percent-encoded (any case, also twice)."""
    forms = [re.escape(char)]
    code = ord(char)
    units = [code] if code < 0x10000 else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
    forms.append("".join(r"\\+u" + _hex(unit, 4) for unit in units))
    if char in '/"\\':
        forms.append(r"\\+" + re.escape(char))
    forms.append("".join("%(?:25)*" + _hex(byte, 2) for byte in char.encode()))
    return "(?:" + "|".join(forms) + ")"


def _base64_cores(secret: bytes) -> list[bytes]:
    """The base64 text that encodes `secret` wherever it starts in the encoded input: for each of the
    three alignments, the whole 4-character groups made of the secret's bytes alone. So the base64
    of the key, of `Bearer <key>` and of `<user>:<key>` each contain one of these."""
    cores: list[bytes] = []
    for skip in range(3):
        aligned = secret[skip:]
        aligned = aligned[:len(aligned) - len(aligned) % 3]
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            core = encode(aligned)
            if len(core) >= MIN_SECRET_CHARS and core not in cores:
                cores.append(core)
    return cores


def _anchor(form: bytes) -> bytes:
    """The longest run of letters and digits in `form`: what JSON and URL encoders leave as it is."""
    return max(_LETTERS_AND_DIGITS.findall(form), key=len, default=b"")


class SecretScrubber:
    """Finds and replaces one secret in its raw, escaped and encoded forms; built once per replica."""

    __slots__ = ("in_success_answers", "anchor", "_anchors", "_text_anchors", "_bytes_pattern", "_text_pattern")

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("nothing to scrub")
        raw = secret.encode()
        # placeholders are scrubbed from errors only (see MIN_SECRET_CHARS), and not in base64
        self.in_success_answers = len(secret) >= MIN_SECRET_CHARS
        forms = [raw] + (_base64_cores(raw) if self.in_success_answers else [])
        # a form without a long enough run is its own anchor: then only as itself does it pass the cheap check
        anchors = [anchor if len(anchor := _anchor(form)) >= MIN_SECRET_CHARS else form for form in forms]
        self.anchor = anchors[0]  # the cheap check: the key's own, in plain or escaped forms
        self._anchors = tuple(dict.fromkeys(anchors))  # the thorough check: base64 forms too
        self._text_anchors = tuple(anchor.decode() for anchor in self._anchors) + ("\\", "%")
        # longest first: a form that contains another is replaced whole
        texts = sorted((form.decode() for form in forms), key=len, reverse=True)
        text_pattern = "|".join("".join(_any_form(char) for char in text) for text in texts)
        self._text_pattern = re.compile(text_pattern)
        self._bytes_pattern = re.compile(text_pattern.encode())

    def found(self, data: bytes, thorough: bool = False) -> bool:
        """Whether `data` may hold the secret: the cheap check, or with `thorough` every known form."""
        if not thorough:
            return data.find(self.anchor) >= 0
        for anchor in self._anchors:
            if data.find(anchor) >= 0:
                return True
        # letters and digits escaped too: look again with the escapes undone (`find`, not `in`: for
        # one byte it is memchr, several times faster)
        unescaped = data
        if unescaped.find(b"\\") >= 0:
            unescaped = _JSON_ESCAPED_BYTE.sub(_unescape_byte, unescaped)
        if unescaped.find(b"%") >= 0:
            unescaped = _PERCENT_ENCODED_BYTE.sub(_unescape_byte, unescaped)
        return unescaped is not data and any(unescaped.find(anchor) >= 0 for anchor in self._anchors)

    def scrub_answer(self, status: int, body: bytes) -> bytes:
        """A whole answer: an error (status >= 400, or a body with an `"error"`) gets the thorough check."""
        thorough = status >= 400 or body.find(b'"error"') >= 0
        if not (thorough or self.in_success_answers) or not self.found(body, thorough):
            return body
        return self.scrub(body)

    def scrub(self, data: bytes) -> bytes:
        """`data` with every form of the secret replaced; a JSON document stays valid JSON."""
        scrubbed = self._scrub_json(data)
        return scrubbed if scrubbed is not None else self._bytes_pattern.sub(_REDACTED_BYTES, data)

    def scrub_lines(self, data: bytes) -> bytes:
        """Scrubs each line of an SSE text on its own: a `data:` line's JSON stays valid JSON."""
        lines = data.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data:"):
                payload = line[5:]
                lead = b" " if payload.startswith(b" ") else b""
                end = b"\r" if payload.endswith(b"\r") else b""
                scrubbed = self._scrub_json(payload[len(lead):len(payload) - len(end)])
                if scrubbed is not None:
                    lines[index] = b"data:" + lead + scrubbed + end
                    continue
            lines[index] = self._bytes_pattern.sub(_REDACTED_BYTES, line)
        return b"\n".join(lines)

    def _scrub_json(self, data: bytes) -> bytes | None:
        """The document with the secret replaced in its strings (as it came when none held it);
        None when not JSON, or too deep to walk: then the caller's byte-level patterns do it."""
        try:
            document = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        replaced = [0]
        try:
            scrubbed = self._walk(document, replaced)
            return orjson.dumps(scrubbed) if replaced[0] else data
        except (RecursionError, orjson.JSONEncodeError):  # orjson writes 255 levels, reads 1024
            return None

    def _walk(self, value: object, replaced: list[int]) -> object:
        if isinstance(value, str):
            return self._scrub_text(value, replaced)
        if isinstance(value, list):
            return [self._walk(item, replaced) for item in value]
        if isinstance(value, dict):
            return {self._scrub_text(key, replaced): self._walk(item, replaced) for key, item in value.items()}
        return value

    def _scrub_text(self, text: str, replaced: list[int]) -> str:
        # the regex tries many forms at every character: only strings with an anchor or an escape
        if not any(anchor in text for anchor in self._text_anchors):
            return text
        text, count = self._text_pattern.subn(REDACTED, text)
        replaced[0] += count
        return text


class StreamScrubber:
    """Scrubs a streamed answer line by line as it passes: a line is held until its end arrives, so
    a key split across two reads from the upstream is still found whole."""

    __slots__ = ("scrubber", "pieces", "_partial_line")

    def __init__(self, scrubber: SecretScrubber) -> None:
        self.scrubber = scrubber
        self.pieces: list[bytes] = []  # what arrived since the last `drain`
        self._partial_line = b""

    def drain(self, out: list[bytes], at_end: bool = False) -> None:
        """Appends to `out` the complete lines that arrived, scrubbed; at the end, the rest too."""
        pieces = self.pieces
        if not pieces and not (at_end and self._partial_line):
            return
        data = self._partial_line + (pieces[0] if len(pieces) == 1 else b"".join(pieces))
        pieces.clear()
        if at_end:
            ready, self._partial_line = data, b""
        else:
            cut = data.rfind(b"\n")
            if cut < 0:
                cut = data.rfind(b"\r")  # SSE may end lines with a lone CR
            ready, self._partial_line = data[:cut + 1], data[cut + 1:]
        if not ready:
            return
        scrubber = self.scrubber
        if ready.find(b'"error"') >= 0:  # an error event (or a line that mentions one): every form
            if scrubber.found(ready, thorough=True):
                ready = scrubber.scrub_lines(ready)
        elif scrubber.in_success_answers and ready.find(scrubber.anchor) >= 0:  # the cheap `found`, inlined
            ready = scrubber.scrub_lines(ready)
        out.append(ready)


def safe_content_type(value: bytes, default: bytes, scrubber: SecretScrubber | None) -> bytes:
    """The upstream's content-type if it is a plain API media type holding no secret, else `default`."""
    if value in _USUAL_CONTENT_TYPES:
        return value
    if len(value) > _MAX_CONTENT_TYPE_BYTES or _MEDIA_TYPE.fullmatch(value) is None:
        return default
    if scrubber is not None and scrubber.found(value, thorough=True):
        return default
    return value
