"""`tidegate <command>`: the only module that imports every package.

Each command lives in its own module exposing `configure_parser(parser)` and `run(args) -> int`;
modules are imported lazily so that `tidegate serve` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "COMMANDS"]

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tidegate.gateway.cli", "run the OpenAI-compatible gateway (embedded engine pool by default)"),
    "engine": ("tidegate.engine.cli", "run one embedded engine worker (one replica)"),
    "mock-upstream": ("tidegate.mock.cli", "run a mock OpenAI-compatible upstream with latency models"),
    "bench": ("tidegate.loadgen.cli", "load-generate against an OpenAI-compatible endpoint"),
    "report": ("tidegate.loadgen.report_cli", "show a bench or sim report again, or compare two side by side"),
    "sim": ("tidegate.sim_cli", "simulate a pool on a replica profile; calibrate a profile against an engine"),
    "plan": ("tidegate.plan_cli", "plan replicas per window of a trace: the seeds' formula, verified in the simulator"),
    "chaos": ("tidegate.chaos.cli", "inject faults into a running deployment under load; report what it did"),
}


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidegate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text)
        # configure only the command being run: keeps start-up light and isolates import errors
        if name == wanted:
            module = importlib.import_module(module_name)
            module.configure_parser(command_parser)
            command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)
