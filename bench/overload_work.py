"""Overload control's own work per request, in one process, as the proxy calls it, stage by stage.

    python bench/overload_work.py [--requests 20000] [--rounds 5]
    python bench/overload_work.py --instructions [--stages loop settle]  # instructions a request, by stage

Builds a gateway from the same configuration as bench/gateway_overhead.py's (overload control on, no
tenants, one upstream replica; nothing is started) and drives its `OverloadRuntime` as the proxy does
for a non-streaming request answered at once: authenticate, admit, acquire, ended, settle. Prints
microseconds a request, best of rounds.

--instructions: the same loop under callgrind, stopped after each stage in turn (`--upto`), at two
request counts; the difference divided by the requests between them is the instructions a request
of the stages so far, exact and unmoved by other load (compare bench/gateway_instructions.py, the
whole live gateway's).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from stage_instructions import print_stages  # noqa: E402
from tidegate.config import parse_config  # noqa: E402
from tidegate.gateway.app import Gateway  # noqa: E402
from tidegate.types import ReplicaHealth  # noqa: E402

BODY = {"model": "mock", "stream": False, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say something short."}]}
RAW_BODY = (b'{"model":"mock","stream":false,"max_tokens":16,'
            b'"messages":[{"role":"user","content":"Say something short."}]}')
STAGES = ("loop", "authenticate", "admit", "acquire", "ended", "settle")
CONFIG = """overload_control: true
server:
  port: 9
  access_log: false
pools:
  - name: mock
    backends:
      - type: upstream
        url: http://127.0.0.1:9/v1
"""


async def run(requests: int, upto: str) -> float:
    """CPU seconds for `requests` requests up to stage `upto`."""
    gateway = Gateway(parse_config(CONFIG))
    overload = gateway.overload
    assert overload is not None
    for pool in gateway.pools.values():  # as its first health check finds them
        for replica in pool.replicas:
            replica.health = ReplicaHealth.HEALTHY
        pool.controlled(time.monotonic())
    last = STAGES.index(upto)
    clock = time.monotonic
    started = time.process_time()
    for number in range(requests):
        if last < 1:
            continue
        # as the proxy: without API keys the anonymous identity resolved once, else the key's
        identity = overload.anonymous or overload.authenticate(None)
        if last < 2:
            continue
        ticket = overload.admit(clock(), str(number), identity, "mock", BODY, None, False,
                                fingerprint=hash(RAW_BODY) ^ hash(identity.tenant))
        if last < 3:
            overload.settle(ticket, 0)  # else the slots fill up
            continue
        await overload.acquire(ticket)
        if last >= 4:
            overload.ended(ticket, None)
        overload.settle(ticket, 16 if last >= 5 else 0)
    return time.process_time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--upto", choices=STAGES, default=STAGES[-1], help="stop each request after this stage")
    parser.add_argument("--instructions", action="store_true", help="instructions a request by stage (valgrind)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, help="--instructions: only up to these stages")
    args = parser.parse_args()
    if args.instructions:
        return print_stages(__file__, args.stages or list(STAGES))
    seconds = min(asyncio.run(run(args.requests, args.upto)) for _ in range(args.rounds))
    print(f"{args.requests} requests up to {args.upto}, best of {args.rounds}: "
          f"{seconds / args.requests * 1e6:.2f} us a request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
