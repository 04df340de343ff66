"""`tidegate chaos`: fault injection against a running deployment, with a report.

  tidegate chaos run experiment.yaml [--out DIR] [--fail-under 99.5]
  tidegate chaos check experiment.yaml
  tidegate chaos proxy --listen 127.0.0.1:9103 --target 127.0.0.1:9003 [--admin 127.0.0.1:9203] [--faults YAML]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    sub = parser.add_subparsers(dest="chaos_command", metavar="SUBCOMMAND", required=True)

    run_parser = sub.add_parser("run", help="run an experiment: load, faults on a timeline, a report")
    run_parser.add_argument("experiment", help="the experiment's YAML (docs/chaos.md)")
    run_parser.add_argument("--out", help="directory for chaos-report.json and the logs of what the run started")
    run_parser.add_argument("--fail-under", type=float, metavar="PCT",
                            help="exit 1 when fewer than PCT %% of the requests succeeded")
    run_parser.add_argument("--quiet", action="store_true", help="no tables on the terminal")

    check_parser = sub.add_parser("check", help="validate an experiment file; start nothing")
    check_parser.add_argument("experiment")

    proxy_parser = sub.add_parser("proxy", help="run a fault proxy in front of one upstream")
    proxy_parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    proxy_parser.add_argument("--target", required=True, metavar="HOST:PORT")
    proxy_parser.add_argument("--admin", default="127.0.0.1:0", metavar="HOST:PORT",
                              help="the admin endpoint, on loopback (default: a free port, printed)")
    proxy_parser.add_argument("--faults", default="pass",
                              help="faults at start, YAML or JSON, e.g. '{error: {status: 500, probability: 0.3}}'")
    proxy_parser.add_argument("--raw-tcp", action="store_true",
                              help="forward bytes without reading HTTP (no error injection or per-request faults)")
    proxy_parser.add_argument("--seed", type=int, default=None, help="seed of the fault draws")


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {value!r}")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    try:
        if args.chaos_command == "proxy":
            return _run_loop(_serve_proxy(args))
        from tidegate.chaos.experiment import load_experiment

        experiment = load_experiment(args.experiment)
    except ValueError as error:  # ExperimentError is one: the message names the file and the key
        print(f"tidegate chaos: {error}", file=sys.stderr)
        return 2
    if args.chaos_command == "check":
        print(f"{args.experiment}: {len(experiment.steps)} steps over {experiment.duration_s:g} s, valid")
        return 0
    return _run_experiment(experiment, args)


def _run_experiment(experiment, args: argparse.Namespace) -> int:
    import tempfile

    import orjson

    from tidegate.chaos.report import build_report, print_report
    from tidegate.chaos.runner import run_experiment

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tidegate-chaos-"))
    out.mkdir(parents=True, exist_ok=True)

    def show(event) -> None:
        if not args.quiet:
            print(f"[{event.t_s:7.2f} s] {event.action} {event.subject}: {event.outcome.value}: {event.detail}",
                  flush=True)

    try:
        result = _run_loop(run_experiment(experiment, log_dir=str(out), on_event=show))
    except (ValueError, RuntimeError, OSError) as error:
        print(f"tidegate chaos: {error}", file=sys.stderr)
        return 2
    report = build_report(result)
    if not args.quiet:
        print_report(report)
    path = out / "chaos-report.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"report: {path}")
    for process in result.restarted:
        print(f"left running: pid {process.pid} ({' '.join(map(str, process.args))})")
    success = report["summary"]["success_pct"]
    if args.fail_under is not None and (success is None or success < args.fail_under):
        print(f"tidegate chaos: success {success if success is not None else 'n/a'} % is under {args.fail_under:g} %",
              file=sys.stderr)
        return 1
    return 0


async def _serve_proxy(args: argparse.Namespace) -> int:
    from tidegate.chaos.fault_proxy import FaultProxy
    from tidegate.chaos.faults import parse_fault_set
    from tidegate.chaos.proxy_admin import start_admin

    import yaml

    listen_host, listen_port = _host_port(args.listen, "--listen")
    target_host, target_port = _host_port(args.target, "--target")
    admin_host, admin_port = _host_port(args.admin, "--admin")
    try:
        faults = parse_fault_set(yaml.safe_load(args.faults), "--faults")
    except yaml.YAMLError as error:
        raise ValueError(f"--faults is not valid YAML or JSON: {error}") from None
    proxy = FaultProxy(listen_host, listen_port, target_host, target_port, faults, http=not args.raw_tcp,
                       seed=args.seed)
    await proxy.start()
    admin = await start_admin(proxy, admin_host, admin_port)
    admin_url = f"http://{admin_host}:{admin.addresses[0][1]}"
    print(f"tidegate chaos proxy: {listen_host}:{proxy.port} -> {target_host}:{target_port}; faults: "
          f"{faults.summary()}; admin {admin_url} (GET/PUT/DELETE /faults, GET /counters)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await admin.cleanup()
    await proxy.stop()
    return 0


def _run_loop(coroutine):
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio works too
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
