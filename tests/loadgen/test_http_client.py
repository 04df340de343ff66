"""Target URLs and request bytes."""

from __future__ import annotations

import pytest

from tidegate.loadgen.http_client import Endpoint, HttpClient, parse_url


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", Endpoint("127.0.0.1", 8000, "")),
    ("http://127.0.0.1:8000/v1", Endpoint("127.0.0.1", 8000, "")),  # an OpenAI-style base URL
    ("http://localhost/proxy/", Endpoint("localhost", 80, "/proxy")),
])
def test_urls_parse_to_host_port_and_prefix(url: str, expected: Endpoint) -> None:
    assert parse_url(url) == expected


def test_post_carries_length_type_and_auth() -> None:
    data = HttpClient(parse_url("http://127.0.0.1:9/p")).render("POST", "/v1/x", b"{}", b"Authorization: Bearer k\r\n")
    assert data == (b"POST /p/v1/x HTTP/1.1\r\nHost: 127.0.0.1:9\r\nAuthorization: Bearer k\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")


def test_metrics_are_fetched_from_the_server_root() -> None:
    data = HttpClient(parse_url("http://127.0.0.1:9/p")).render("GET", "/metrics", under_base=False)
    assert data == b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"
