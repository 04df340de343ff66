"""Loopback only unless the user names the remote host."""

from __future__ import annotations

import pytest

from tidegate.cli import main
from tidegate.loadgen.cli import check_target_allowed
from tidegate.loadgen.http_client import parse_url


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.9.9.9:1", "http://[::1]:8000", "http://localhost:80"])
def test_loopback_targets_are_allowed(url: str) -> None:
    check_target_allowed(parse_url(url), [])


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://api.example.com", "http://0.0.0.0:8000"])
def test_other_hosts_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="--allow-remote-host"):
        check_target_allowed(parse_url(url), [])


def test_a_named_remote_host_is_allowed() -> None:
    check_target_allowed(parse_url("http://api.example.com:8080"), ["api.example.com"])


def test_bench_refuses_a_remote_target_before_sending(capsys) -> None:
    assert main(["bench", "--url", "http://192.0.2.1:8000", "--requests", "1", "--no-progress"]) == 2
    assert "--allow-remote-host" in capsys.readouterr().err


def test_https_is_refused_with_a_clear_message(capsys) -> None:
    assert main(["bench", "--url", "https://127.0.0.1:8000", "--requests", "1"]) == 2
    assert "http://" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rate", "--requests", "--concurrency", "--speedup"])
def test_non_positive_numbers_are_refused(flag: str, capsys) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", flag, "0", "--no-progress"]) == 2
    assert "must be positive" in capsys.readouterr().err
