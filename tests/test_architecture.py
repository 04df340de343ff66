"""The import direction of ../DESIGN: policy is pure; the simulator never imports the gateway."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tidegate"

# package -> tidegate packages/modules it may import
ALLOWED = {
    "policy": {"tidegate.policy", "tidegate.types", "tidegate.clock"},
    # the engine's pure scheduling modules, so modelled replicas batch exactly as the engine does
    "sim": {"tidegate.sim", "tidegate.policy", "tidegate.types", "tidegate.clock", "tidegate.loadgen",
            "tidegate.errors", "tidegate.engine.scheduler", "tidegate.engine.kv_cache", "tidegate.engine.sequence",
            "tidegate.engine.mirror_rows"},
}
# modules no policy may import: policies get time and I/O results as arguments
IMPURE_FOR_POLICY = {"asyncio", "time", "socket", "threading", "aiohttp", "httptools", "uvloop", "random"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    for path in _modules(package):
        for name in _imports(path):
            if name == "tidegate" or name.startswith("tidegate."):
                assert any(name == ok or name.startswith(ok + ".") for ok in ALLOWED[package]), (
                    f"{path.relative_to(SRC)} imports {name}"
                )


def test_policies_do_no_io_and_read_no_clock() -> None:
    for path in _modules("policy"):
        for name in _imports(path):
            assert name.split(".")[0] not in IMPURE_FOR_POLICY, f"{path.relative_to(SRC)} imports {name}"


# the simulator runs on virtual time: no event loop of asyncio's, no HTTP, no clock reads
IMPURE_FOR_SIM = {"asyncio", "aiohttp", "time"}
# the engine modules the simulator borrows must stay free of I/O, threads, clocks and torch
PURE_ENGINE_MODULES = ("scheduler", "kv_cache", "sequence", "mirror_rows")
IMPURE_FOR_ENGINE_CORE = {"asyncio", "time", "socket", "threading", "aiohttp", "torch"}


def test_simulator_reads_no_clock_and_runs_no_event_loop() -> None:
    for path in _modules("sim"):
        for name in _imports(path):
            assert name.split(".")[0] not in IMPURE_FOR_SIM, f"{path.relative_to(SRC)} imports {name}"


# importing them runs the engine package's __init__ first: it must stay as pure
@pytest.mark.parametrize("module", ("__init__", *PURE_ENGINE_MODULES))
def test_engine_modules_the_simulator_borrows_are_pure(module: str) -> None:
    path = SRC / "engine" / f"{module}.py"
    borrowed = {f"tidegate.engine.{m}" for m in PURE_ENGINE_MODULES}
    for name in _imports(path):
        assert name.split(".")[0] not in IMPURE_FOR_ENGINE_CORE, f"{path.relative_to(SRC)} imports {name}"
        if name.startswith("tidegate."):
            assert name in borrowed, f"{path.relative_to(SRC)} imports {name}"


# pure modules outside policy/: what they may import of tidegate, and no I/O, clock, event loop or torch
PURE_MODULES = {
    # the semantic cache's core: numpy only; the gateway embeds, stores and persists around it
    "cache/semantic.py": ("tidegate.cache.answer_guard",),
    "cache/answer_guard.py": (),
    "cache/response.py": (),
    # spans to OTLP protobuf bytes; the gateway's exporter sends them
    "telemetry/otlp.py": (),
}
IMPURE_FOR_PURE_MODULES = IMPURE_FOR_POLICY | {"torch", "transformers", "redis", "httpx", "os", "io", "pathlib"}


@pytest.mark.parametrize("module", sorted(PURE_MODULES))
def test_pure_modules_do_no_io_and_import_nothing_impure(module: str) -> None:
    for name in _imports(SRC / module):
        assert name.split(".")[0] not in IMPURE_FOR_PURE_MODULES, f"{module} imports {name}"
        if name == "tidegate" or name.startswith("tidegate."):
            assert any(name == ok or name.startswith(ok + ".") for ok in PURE_MODULES[module]), (
                f"{module} imports {name}")


def test_no_relative_imports() -> None:
    # absolute imports name the package a module leans on, which these checks read
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
        assert not relative, f"{path.relative_to(SRC)}: relative import on line(s) {relative}"


# the live gateway is one body; these must not lean on it (the simulator is the other body)
@pytest.mark.parametrize("package", ["engine", "loadgen", "mock", "sim", "policy", "control", "telemetry"])
def test_package_stays_off_the_gateway(package: str) -> None:
    for path in _modules(package):
        for name in _imports(path):
            assert not name.startswith("tidegate.gateway"), f"{path.relative_to(SRC)} imports {name}"


def test_batcher_is_pure() -> None:
    # the embeddings batcher decides batches from times passed in; its worker does the I/O
    for name in _imports(SRC / "engine" / "batching.py"):
        assert name.split(".")[0] not in IMPURE_FOR_ENGINE_CORE, f"engine/batching.py imports {name}"


def test_cli_lists_every_command_module() -> None:
    from tidegate.cli import COMMANDS

    for module_name, _help in COMMANDS.values():
        relative = module_name.removeprefix("tidegate.").replace(".", "/") + ".py"
        assert (SRC / relative).exists(), f"{module_name} is missing"


# configuration is read by every body and by the tools; it leans on nothing but the pure policies it
# builds (and the shared records), never on a body: the gateway, engine, simulator, control plane
CONFIG_MODULES = ("config.py", "overload_config.py")
CONFIG_MAY_IMPORT = ("tidegate.policy", "tidegate.types", "tidegate.errors", "tidegate.overload_config")


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_is_a_leaf_above_the_pure_policies(module: str) -> None:
    for name in _imports(SRC / module):
        if name == "tidegate" or name.startswith("tidegate."):
            assert name.startswith(CONFIG_MAY_IMPORT), f"{module} imports {name}"
