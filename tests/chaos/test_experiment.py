"""Experiment files: the shipped examples parse, and bad input is refused with its location named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidegate.chaos.experiment import ExperimentError, KillAction, load_experiment, parse_experiment
from tidegate.chaos.faults import LatencyScope
from tidegate.cli import main
from tidegate.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

VALID = """
name: t
duration_s: 20
load: {url: "http://127.0.0.1:8000", rate: 5}
targets:
  replicas:
    - {port: 9001, restart: "tidegate mock-upstream --port 9001"}
    - {pid: 1234}
proxies:
  flaky: {listen: "127.0.0.1:9103", target: "127.0.0.1:9003"}
steps:
  - {at_s: 5, kill: {target: replicas, fraction: 0.2}}
  - {at_s: 15, restart: {target: replicas}}
  - {at_s: 8, proxy: {name: flaky, faults: {error: {status: 500, probability: 0.3}}}}
  - {at_s: 12, proxy: {name: flaky, faults: pass}}
"""


def _error(text: str) -> str:
    with pytest.raises(ExperimentError) as raised:
        parse_experiment(text, source="bad.yaml")
    return str(raised.value)


@pytest.mark.parametrize("name", ["chaos-kill-restart.yaml", "chaos-network.yaml"])
def test_shipped_examples_parse(name: str) -> None:
    experiment = load_experiment(EXAMPLES / name)
    assert experiment.steps


def test_the_examples_gateway_fronts_the_proxy_the_experiment_starts() -> None:
    experiment = load_experiment(EXAMPLES / "chaos-kill-restart.yaml")
    urls = [backend.url for pool in load_config(EXAMPLES / "chaos-gateway.yaml").pools for backend in pool.backends]
    assert f"http://{experiment.proxies['flaky'].listen}/v1" in urls


def test_a_valid_experiment_reads_commands_faults_and_steps() -> None:
    experiment = parse_experiment(VALID)
    replicas = experiment.targets["replicas"]
    assert replicas[0].restart == ("tidegate", "mock-upstream", "--port", "9001")
    kill = experiment.steps[0]
    assert kill.action_name == "kill" and isinstance(kill.action, KillAction) and kill.action.fraction == 0.2
    assert experiment.steps[2].proxy.faults.error.probability == 0.3
    assert experiment.steps[3].proxy.faults.is_pass()


def test_latency_scopes_are_named_states() -> None:
    text = VALID.replace("faults: {error: {status: 500, probability: 0.3}}",
                         "faults: {latency: {ms: 50, per: [connection, chunk]}}")
    faults = parse_experiment(text).steps[2].proxy.faults
    assert faults.latency.per == (LatencyScope.CONNECTION, LatencyScope.CHUNK)


@pytest.mark.parametrize(("change", "expected"), [
    (("fraction: 0.2", "fraction: 1.5"), "steps.0.kill.fraction: Input should be less than or equal to 1"),
    (("rate: 5", "rate: 5, colour: red"), "load.colour: unknown key"),
    (("status: 500", "status: 700"), "steps.2.proxy.faults.error.status"),
    (("probability: 0.3", "probabilty: 0.3"), "steps.2.proxy.faults.error.probabilty: unknown key"),
    (("{pid: 1234}", "{pid: 1234, port: 9002}"), "targets.replicas.1: give exactly one of pid, port"),
    (("kill: {target: replicas, fraction: 0.2}", "kill: {target: replicaz}"), "no target group 'replicaz'"),
    (("proxy: {name: flaky, faults: pass}", "proxy: {name: flakey, faults: pass}"), "no proxy 'flakey'"),
    (("at_s: 15", "at_s: 25"), "steps.1.at_s: 25 is not within duration_s (20)"),
    (('listen: "127.0.0.1:9103", ', ""), "give listen and target"),
    (('target: "127.0.0.1:9003"', 'target: "nowhere"'), "expected host:port"),
    (("{at_s: 5, kill: {target: replicas, fraction: 0.2}}",
      "{at_s: 5, kill: {target: replicas}, pause: {target: replicas, duration_s: 1}}"), "this one does kill and pause"),
])
def test_bad_input_is_named_by_its_location(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in VALID
    message = _error(VALID.replace(old, new, 1))
    assert message.startswith("bad.yaml: experiment: invalid")
    assert expected in message


def test_bad_length_spec_says_which_forms_exist() -> None:
    assert "const:N" in _error(VALID.replace("rate: 5", 'rate: 5, max_tokens: "lots"'))


def test_restart_of_members_without_a_command_is_refused() -> None:
    text = VALID.replace(', restart: "tidegate mock-upstream --port 9001"', "")
    assert "no member of 'replicas' has a restart command" in _error(text)


def test_not_yaml_and_not_a_mapping_are_refused() -> None:
    assert "not valid YAML" in _error("steps: [")
    assert "expected a mapping at the top level" in _error("- just a list")


def test_cli_check_reports_errors_with_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(VALID.replace("fraction: 0.2", "fraction: 0"))
    assert main(["chaos", "check", str(path)]) == 2
    assert "steps.0.kill.fraction: Input should be greater than 0" in capsys.readouterr().err
    path.write_text(VALID)
    assert main(["chaos", "check", str(path)]) == 0
    assert main(["chaos", "check", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
