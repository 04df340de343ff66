"""How long a spare's refill takes while the pool stays under load: the embedded scenario of
`bench/chaos.py` with a spare (two `tidegate engine` workers serving, one loaded out of traffic),
one serving worker SIGKILLed at 5 s, but the load kept on long enough that the dead worker's
restart (the refill, loading at the loading priority of `control/priority.py`) can finish under it.

    python bench/spare_refill.py [--load-s 90] [--load-fraction 0.7] [--overload-control]

Prints what the embedded scenario prints for its spare arm: the refill's load time after the kill
and whether the load was still running then, the refill's CPU (share of a core) and its threads'
nice values from the kill until it was a standby, the serving engines' CPU before and meanwhile,
the e2e medians by send window, served requests and success. For the pool, the refill's time is
the time it has no spare: a second death then finds none. Bounded: one arm, `--load-s` of load
(at most 300), the refill followed up to 60 s past it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from chaos_embedded import _run_arm, _window_p50
from chaos_kit import BenchOptions, Processes


async def main(load_s: float, load_fraction: float, overload_control: bool) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="tidegate-bench-refill-"))
    procs = Processes(log_dir)
    print(f"spare refill under load: {load_s:g} s of load at {load_fraction:.0%} of the measured capacity, "
          f"overload_control {'on' if overload_control else 'off'}; logs in {log_dir}")
    try:
        arm = await _run_arm(BenchOptions(overload_control), procs, log_dir, 1, None, load_s, load_fraction)
    finally:
        procs.stop_all()
    outcome, kill_t_s = arm["outcome"], arm["kill_t_s"]
    loaded_t_s = kill_t_s + outcome.get("refill_s", float("nan"))
    if loaded_t_s == loaded_t_s:  # the refill was seen loaded: how the requests fared while it loaded
        windows = {"before the kill": (0.0, kill_t_s), "while the refill loaded": (kill_t_s, loaded_t_s),
                   "after it loaded": (loaded_t_s, load_s + 1)}
        print("  e2e p50 by send time (failed requests as the slowest): " + "; ".join(
            f"{label} {_window_p50(arm['result'], *span)[0]:.3f} s" for label, span in windows.items()))
    print("  row " + " ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                              for key, value in arm["outcome"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-s", type=float, default=90.0, help="seconds of load (kill at 5 s; at most 300)")
    parser.add_argument("--load-fraction", type=float, default=0.7, help="load as a fraction of the measured capacity")
    parser.add_argument("--overload-control", action="store_true")
    args = parser.parse_args()
    if not 10 <= args.load_s <= 300:
        parser.error("--load-s must be within 10..300")
    sys.exit(asyncio.run(asyncio.wait_for(main(args.load_s, args.load_fraction, args.overload_control),
                                          args.load_s + 400)))
