"""Issue 5's bars, live: `tidegate serve` with overload control vs the FIFO baseline, same run.

Two gateways run side by side over the same two replicas; each phase is run on the FIFO gateway
(overload control off: FIFO queue, static slot limit) and then on tidegate (overload control on),
alternating, with the replicas drained in between. Figures printed:

  capacity    completed req/s of a closed loop past the replicas' knee
  goodput     requests that finish and meet their tier's TTFT target, per second, at 1x/2x/4x capacity;
              bar: tidegate at 2x and 4x >= 90 % of its goodput at 1x (FIFO printed beside)
  critical    critical P99 TTFT during a 3x sheddable burst vs critical alone; bar <= 1.5x
  noisy       other tenants' P99 TTFT while one tenant sends 10x its share vs all at their share
              (shares add up to 0.8x capacity: the provisioned rate); bar < +20 %
  rejection   p99 of the gateway's own arrival-to-answer time of admission refusals; bar < 5 ms
  slowed      a replica slowed 2x: the pool controller's fitted TTFT line for it (seconds per prefill
              token, which sets its work budget) against the other replica's; bar: the ratio within 2x
              +-25 % no later than 10 s after the slowdown, and staying there

Replicas (`--replicas`): `embedded` (default) runs two `tidegate engine` processes (the engine
`tidegate serve` starts for its embedded pool; started here as upstreams so that both gateways share
them, the bench can drain them between phases, and `--fault-injection` can slow one 2x), one torch
thread each; the gateways and the load generator share the same 2 cores, so the engines slow down
as offered load rises, and the figures include that. Each replica's `slot_limit` is its engine's
batch (64 sequences); the pool controller splits it into requests and headroom and budgets the
prefill work by its fitted TTFT line. `knee-mock` runs `bench/overload_knee_mock.py`, a modelled
batching engine with a flat knee (no prefill cost, no KV limit).

Run: flock /tmp/tidegate-bench.lock python bench/overload.py [--phase-s 12] [--only critical|goodput|noisy|slowed]
       [--replicas knee-mock|embedded]
(`--only`: capacity and that bar alone, for iterating; not a verdict on all bars)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from overload_measure import METRICS_KEY
from overload_measure import (EMBEDDED_MODEL, PROMPT_TOKENS, TENANTS, TOKENS, Phase, Processes, drain,
                              engine_sequences, free_port, goodput_rps, histogram_p99, http_text, p99_ttft, refusals,
                              replica_gauge, run_closed, run_open, run_open_beside_flood, served, slowest,
                              ttft_summary)

HERE = Path(__file__).resolve().parent
KNEE, STEP_MS, MAX_RUNNING = 4, 25.0, 64
REPLICAS = 2
# the noisy-tenant bar's shares add up to this fraction of the measured capacity: what a service is
# provisioned to carry with headroom (utilisation 0.8), so the fair baseline is a settled queue
PROVISIONED = 0.8
# the noisy bar also prints the others' P99 split at this many seconds into the flood: before it,
# the gateway may not yet judge the tenant to be flooding (rates average over a 5 s half-life)
DETECTION_S = 10.0
WARMUP_S = 15.0  # before the noisy bar's fair phase, at its load


def gateway_config(port: int, upstreams: list[str], overload: bool, upstream_model: str | None = None) -> dict:
    config: dict = {
        "server": {"port": port, "access_log": False, "queue_timeout_s": 30.0, "metrics_api_key": METRICS_KEY},
        # forward_priority: the embedded engine schedules by the tier's rank (the knee mock ignores
        # it, so it is not told: the gateway would count on a demotion the mock never makes); the
        # embedded replicas are the ones named by a model
        "pools": [{"name": "m", "backends": [{"type": "upstream", "url": url, "health_path": "/health",
                                               "model": upstream_model, "slot_limit": MAX_RUNNING,
                                               "forward_priority": upstream_model is not None}
                                              for url in upstreams]}],
        "tenants": {name: {"api_keys": [f"sk-{name}"], "tier": tier} for name, tier in TENANTS.items()},
        "overload_control": overload,
    }
    return config


async def noisy_tenant_bar(both, capacity: float, standard: list[str], phase_s: float) -> bool:
    """Other tenants' P99 TTFT while one tenant sends 10x its share, vs all at a fair load."""
    ok = True
    # the tenants' shares add up to the provisioned rate, PROVISIONED x capacity: at exactly capacity
    # (rho = 1) the queue never settles, its P99 grows with the phase and swung the baseline by 2x
    # between runs, so a rise measured against it said nothing about the flood
    share = PROVISIONED * capacity / len(standard)
    others = {"t1", "t2", "t3"}
    # fair: every tenant sends its share; noisy: one sends 10x its share. Long enough for ~500 of
    # the others' requests a phase, so that their P99 is not one or two stragglers
    noisy_s = max(phase_s, 500.0 / (len(others) * share))
    # the fair phase is the baseline, so it must be a steady state: a warm-up at the same load first,
    # not measured, lets the limits leave where a cold start (or the critical phases' protection)
    # left them; measured cold, the limits' regrowth inflated tidegate's baseline above FIFO's
    print(f"  (warm-up, not measured: every tenant at its share for {WARMUP_S:.0f} s)")
    await both([(name, share) for name in standard], seed=200, duration_s=WARMUP_S)
    fair = await both([(name, share) for name in standard], seed=201, duration_s=noisy_s)
    noisy = await both([(name, share) for name in others], seed=202, duration_s=noisy_s,
                       flood=[("noisy", 10 * share)])
    for mode in ("fifo", "tidegate"):
        before, during = p99_ttft(fair[mode], others), p99_ttft(noisy[mode], others)
        rise = during / before - 1.0
        verdict = "" if mode == "fifo" else f" (bar < +20 %: {'PASS' if rise < 0.2 else 'FAIL'})"
        ok &= mode == "fifo" or rise < 0.2
        print(f"others' P99 TTFT {mode}: fair {before * 1000:.0f} ms, noisy tenant at 10x share "
              f"{during * 1000:.0f} ms -> {rise * 100:+.0f} %{verdict}  [others {served(noisy[mode], others)}, "
              f"noisy {served(noisy[mode], {'noisy'})}; {noisy_s:.0f} s phases]")
        if mode == "tidegate":  # the same flood phase against the other gateway's fair baseline
            print(f"  against FIFO's fair P99 ({p99_ttft(fair['fifo'], others) * 1000:.0f} ms): "
                  f"{(during / p99_ttft(fair['fifo'], others) - 1.0) * 100:+.0f} %")
        print(f"  others' TTFT p50/p90/p99 ms: fair {ttft_summary(fair[mode], others)}, "
              f"noisy {ttft_summary(noisy[mode], others)}")
        # isolation starts only once the flood is detected: how much of the tail is its first seconds
        # (and, in the fair phase, how much is the limits still growing from where they started)
        for name, phase in (("fair", fair[mode]), ("noisy", noisy[mode])):
            early, late = (p99_ttft(phase, others, sent_from_s, sent_to_s)
                           for sent_from_s, sent_to_s in ((0.0, DETECTION_S), (DETECTION_S, math.inf)))
            print(f"  others' P99 TTFT in the {name} phase, sent in its first {DETECTION_S:.0f} s / after: "
                  + " / ".join(f"{part * 1000:.0f} ms" if not math.isnan(part) else "-" for part in (early, late))
                  + (f"; slowest (sent at s/TTFT ms/send lag ms): {slowest(phase, others, 6)}"
                     if name == "noisy" else ""))
    return ok


# ---- the run -------------------------------------------------------------------------------------

async def main_async(phase_s: float, only: str | None = None, replicas: str = "embedded") -> int:
    processes = Processes()
    # SIGTERM (a `kill`, a CI timeout) cancels the run, so the replicas and gateways started here stop too
    main_task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert main_task is not None
    signal.signal(signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(main_task.cancel))
    try:
        return await _run(processes, phase_s, only, replicas)
    finally:
        processes.stop_all()


def start_replicas(processes: Processes, kind: str) -> list[str]:
    upstreams: list[str] = []
    for _ in range(REPLICAS):
        port = free_port()
        if kind == "embedded":
            # one torch thread each: the two replicas, the gateway and the load generator share 2 cores
            # --fault-injection: POST /admin/slow makes every step 2x slower for the adaptive-slots bar
            argv = [sys.executable, "-m", "tidegate", "engine", "--model", EMBEDDED_MODEL, "--threads", "1",
                    "--port", str(port), "--fault-injection"]
        else:
            argv = [sys.executable, str(HERE / "overload_knee_mock.py"), "--port", str(port), "--knee", str(KNEE),
                    "--step-ms", str(STEP_MS), "--max-running", str(MAX_RUNNING), "--tokens", str(TOKENS)]
        processes.start(argv, f"http://127.0.0.1:{port}/health")
        upstreams.append(f"http://127.0.0.1:{port}/v1")
    return upstreams


def start_gateway(processes: Processes, workdir: Path, mode: str, config: dict) -> str:
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    port = config["server"]["port"]
    processes.start([sys.executable, "-m", "tidegate", "serve", "--config", str(path), "--no-access-log",
                     "--log-level", "warning"], f"http://127.0.0.1:{port}/ready")
    return f"http://127.0.0.1:{port}"


async def _run(processes: Processes, phase_s: float, only: str | None, replicas: str) -> int:
    embedded = replicas == "embedded"
    upstreams = start_replicas(processes, replicas)
    model = EMBEDDED_MODEL if embedded else None
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-overload-"))
    gateways = {"fifo": start_gateway(processes, workdir, "fifo",
                                      gateway_config(free_port(), upstreams, False, upstream_model=model))}
    if embedded:
        print(f"replicas: {REPLICAS} x `tidegate engine --model {EMBEDDED_MODEL} --threads 1`, {TOKENS} tokens/answer, "
              f"{PROMPT_TOKENS}-token prompts; cpu cores: {os.cpu_count()}; phase {phase_s:.0f} s")
        print("NOTE: replicas, gateway and load generator share the cores: the engines' steps slow down as the "
              "generator's load rises, which the figures include")
    else:
        print(f"replicas: {REPLICAS} x knee mock (knee {KNEE} running, step {STEP_MS:.0f} ms, engine cap {MAX_RUNNING}, "
              f"{TOKENS} tokens/answer); cpu cores: {os.cpu_count()}; phase {phase_s:.0f} s")
        print("LIMITATION: replicas are a modelled batching engine (bench/overload_knee_mock.py), not the embedded "
              "engine: no prompt-length prefill cost, no KV limit (`--replicas embedded` runs the real engine)")
    in_flight = REPLICAS * KNEE * 4
    capacity_phase = await run_closed(gateways["fifo"], "t1", concurrency=in_flight, duration_s=phase_s)
    capacity = sum(1 for r in capacity_phase.records if r.ok) / capacity_phase.elapsed_s
    theoretical = "" if embedded else f"; model says {REPLICAS * KNEE / (STEP_MS / 1000.0) / TOKENS:.1f}"
    print(f"capacity: {capacity:.1f} req/s measured (closed loop, {in_flight} in flight){theoretical}")
    drain(upstreams)
    gateways["tidegate"] = start_gateway(processes, workdir, "tidegate", gateway_config(
        free_port(), upstreams, True, upstream_model=model))

    async def both(streams: list[tuple[str, float]], seed: int, duration_s: float = phase_s,
                   flood: list[tuple[str, float]] | None = None) -> dict[str, Phase]:
        out = {}
        for mode in ("fifo", "tidegate"):
            load = asyncio.create_task(
                run_open(gateways[mode], streams, duration_s, seed) if not flood
                else run_open_beside_flood(gateways[mode], streams, flood, duration_s, seed))
            limits: list[float] = []  # the replicas' work budgets, tokens
            aimed_ms: list[float] = []  # their fitted engine TTFT for one more prompt (mean over replicas)
            flooding: list[float] = []  # tenants the gateway judged to be flooding a tier
            sampled_at: list[float] = []  # time.monotonic() of each sample
            engines: list[tuple[float, float]] = []  # sequences the replicas ran and held waiting
            refused_before = refusals(gateways[mode]) if mode == "tidegate" else {}
            while mode == "tidegate" and not load.done():
                await asyncio.sleep(1.0)
                text = await asyncio.to_thread(http_text, gateways[mode] + "/metrics")
                limits.append(sum(replica_gauge(text, "tidegate_replica_work_budget_tokens").values()))
                fixed = replica_gauge(text, "tidegate_replica_ttft_fit_seconds", 'coefficient="fixed"')
                per_token = replica_gauge(text, "tidegate_replica_ttft_fit_seconds", 'coefficient="per_token"')
                one = [fixed[rid] + per_token[rid] * PROMPT_TOKENS for rid in fixed if rid in per_token]
                aimed_ms.append(1000 * float(np.mean(one)) if one else math.nan)
                flooding.append(sum(float(v) for v in re.findall(
                    r"^tidegate_overload_tenants_over_share{[^}]*} (\S+)", text, re.M)))
                sampled_at.append(time.monotonic())
                if flood:
                    engines.append(await asyncio.to_thread(engine_sequences, upstreams))
            out[mode] = await load
            if limits:
                refused = {why: count - refused_before.get(why, 0.0) for why, count in refusals(gateways[mode]).items()}
                refused_text = ", ".join(f"{count:.0f} {why}" for why, count in sorted(refused.items()) if count)
                print(f"  (tidegate's work budgets, all replicas, tokens, sampled each second: median "
                      f"{np.nanmedian(limits):.0f}, range {np.nanmin(limits):.0f}-{np.nanmax(limits):.0f}; fitted "
                      f"engine TTFT of one prompt median {np.nanmedian(aimed_ms):.0f} ms; "
                      f"a tenant judged flooding in {sum(f > 0 for f in flooding)}/{len(flooding)} samples; "
                      f"refused by tier and reason: {refused_text or 'none'})")
                if flood:  # to line the others' slowest requests up with what the limits did
                    print(f"  (each second, at s into the phase: budget/engines' running+waiting/flooding verdict: "
                          + " ".join(f"{at - out[mode].started_s:.1f}:{limit:.0f}/{running:.0f}+{waiting:.0f}/"
                                     + ("F" if judged > 0 else "-")
                                     for at, limit, (running, waiting), judged
                                     in zip(sampled_at, limits, engines, flooding))
                          + ")")
            drain(upstreams)
        return out

    standard = ["t1", "t2", "t3", "noisy"]
    ok = True

    # -- goodput at 1x/2x/4x
    goodput: dict[float, dict[str, float]] = {}
    for factor in (1.0, 2.0, 4.0) if only in (None, "goodput") else ():
        rate = factor * capacity / len(standard)
        phases = await both([(name, rate) for name in standard], seed=int(factor * 10))
        goodput[factor] = {mode: goodput_rps(phase) for mode, phase in phases.items()}
        print(f"goodput at {factor:.0f}x ({factor * capacity:.1f} req/s offered): "
              f"FIFO {goodput[factor]['fifo']:.2f} req/s, tidegate {goodput[factor]['tidegate']:.2f} req/s  "
              f"[{served(phases['fifo'], set(standard))} | {served(phases['tidegate'], set(standard))}]")
    for factor in (2.0, 4.0) if only in (None, "goodput") else ():
        fifo_ratio = goodput[factor]["fifo"] / max(goodput[1.0]["fifo"], 1e-9)
        ratio = goodput[factor]["tidegate"] / max(goodput[1.0]["tidegate"], 1e-9)
        ok &= ratio >= 0.9
        print(f"  goodput {factor:.0f}x / 1x: tidegate {ratio:.2f} (bar >= 0.90: {'PASS' if ratio >= 0.9 else 'FAIL'}); "
              f"FIFO {fifo_ratio:.2f}")

    if only == "goodput":
        print("GOODPUT BAR " + ("PASSES" if ok else "FAILS") + " (--only goodput: the other bars were not run)")
        return 0 if ok else 1

    if only in (None, "critical"):
        # -- critical during a 3x sheddable burst; long enough for ~200 critical requests per phase, so
        # that the P99 is not just the worst one or two of them
        critical_rate = 0.25 * capacity
        critical_s = max(phase_s, 200.0 / critical_rate)
        alone = await both([("gold", critical_rate)], seed=101, duration_s=critical_s)
        burst = await both([("gold", critical_rate)], seed=102, duration_s=critical_s, flood=[("free", 3.0 * capacity)])
        for mode in ("fifo", "tidegate"):
            before, during = p99_ttft(alone[mode], {"gold"}), p99_ttft(burst[mode], {"gold"})
            ratio = during / before
            verdict = "" if mode == "fifo" else f" (bar <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'})"
            ok &= mode == "fifo" or ratio <= 1.5
            print(f"critical P99 TTFT {mode}: alone {before * 1000:.0f} ms, during 3x sheddable burst "
                  f"{during * 1000:.0f} ms -> {ratio:.2f}x{verdict}  [gold {served(burst[mode], {'gold'})}, "
                  f"sheddable {served(burst[mode], {'free'})}; {critical_s:.0f} s phases]")
            print(f"  critical TTFT p50/p90/p99 ms: alone {ttft_summary(alone[mode], {'gold'})}, "
                  f"burst {ttft_summary(burst[mode], {'gold'})}")
            print(f"  slowest critical in the burst (sent at s, TTFT ms, generator's send lag ms): "
                  f"{slowest(burst[mode], {'gold'})}")
    if only == "critical":
        print("CRITICAL BAR " + ("PASSES" if ok else "FAILS") + " (--only critical: the other bars were not run)")
        return 0 if ok else 1
    if only in (None, "noisy"):
        ok &= await noisy_tenant_bar(both, capacity, standard, phase_s)
    if only == "noisy":
        print("NOISY-TENANT BAR " + ("PASSES" if ok else "FAILS") + " (--only noisy: the other bars were not run)")
        return 0 if ok else 1

    if only is None:
        # -- rejection latency, over every tidegate phase so far
        p99_s, count = histogram_p99(http_text(gateways["tidegate"] + "/metrics"), "tidegate_overload_rejection_seconds")
        ok &= count > 0 and p99_s < 0.005
        print(f"rejections answered: {count}, p99 {p99_s * 1000:.2f} ms (gateway's own timing; bar < 5 ms: "
              f"{'PASS' if count and p99_s < 0.005 else 'FAIL'})")

    if only in (None, "slowed"):
        ok &= await slowed_replica_bar(gateways["tidegate"], upstreams, capacity, standard, phase_s)
    print(("ALL BARS PASS" if ok else "SOME BARS FAIL") if only is None else
          "SLOWED BAR " + ("PASSES" if ok else "FAILS") + " (--only slowed: the other bars were not run)")
    return 0 if ok else 1


async def slowed_replica_bar(gateway: str, upstreams: list[str], capacity: float, standard: list[str],
                             phase_s: float) -> bool:
    """Replica 0 slowed 2x under a 2x load: its fitted seconds per prefill token (which sets its work
    budget) against the other replica's should double, within 10 s."""
    text = await asyncio.to_thread(http_text, gateway + "/metrics")
    replica_ids = sorted(replica_gauge(text, "tidegate_replica_work_budget_tokens"))
    slowed, other = replica_ids[0], replica_ids[1]
    slow_port = re.search(r'@[^:]+:([0-9]+)', slowed).group(1)
    slow_url = f"http://127.0.0.1:{slow_port}/admin/slow"
    load = asyncio.create_task(run_open(gateway, [(name, 2.0 * capacity / len(standard)) for name in standard],
                                        phase_s + 30.0, seed=301))
    trace: list[tuple[float, float, dict[str, float]]] = []  # (t since slowed, slope ratio, budgets)
    slowed_at = time.monotonic() + phase_s
    slow_sent = False
    try:
        while not load.done():
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if not slow_sent and now >= slowed_at:
                await asyncio.to_thread(http_text, slow_url, b"2")
                slow_sent = True
            text = await asyncio.to_thread(http_text, gateway + "/metrics")
            slope = replica_gauge(text, "tidegate_replica_ttft_fit_seconds", 'coefficient="per_token"')
            ratio = slope.get(slowed, math.nan) / slope.get(other, math.nan)
            trace.append((now - slowed_at, ratio, replica_gauge(text, "tidegate_replica_work_budget_tokens")))
        phase = await load
    finally:
        await asyncio.to_thread(http_text, slow_url, b"1")
        drain(upstreams)
    print(f"slowed replica (t = s since {slowed.split('@')[0]} was slowed 2x; per-token slope slowed/other, and "
          "each replica's work budget in tokens):")
    for t, ratio, budgets in trace:
        print(f"  t={t:+5.1f}  ratio {ratio:4.2f}  " + "  ".join(
            f"{rid.split('@')[0]}={budgets.get(rid, math.nan):.0f}" for rid in replica_ids))
    settle_t = next((t for t, _, _ in trace if t >= 0 and all(
        abs(r2 / 2.0 - 1.0) <= 0.25 for t2, r2, _ in trace if t2 >= t)), None)
    passed = settle_t is not None and settle_t <= 10.0
    print(f"  within 2x +-25 % from {'never' if settle_t is None else f't={settle_t:.1f} s'} (bar <= 10 s: "
          f"{'PASS' if passed else 'FAIL'})  [served {served(phase, set(standard))}]")
    return passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=12.0, help="seconds of load per phase and mode")
    parser.add_argument("--only", choices=("critical", "goodput", "noisy", "slowed"),
                        help="run capacity and this bar alone (for iterating)")
    parser.add_argument("--replicas", choices=("knee-mock", "embedded"), default="embedded",
                        help="real `tidegate engine` processes (default), or modelled flat-knee engines")
    args = parser.parse_args()
    work = main_async(args.phase_s, args.only, args.replicas)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(work)
    except asyncio.CancelledError:
        print("terminated: the replicas and gateways started here are stopped", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
