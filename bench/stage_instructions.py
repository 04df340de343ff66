"""Instructions a request, stage by stage, of a bench script that can stop each request after a stage.

The script is run under `valgrind --tool=callgrind` with `--requests N --rounds 1 --upto STAGE`, at
two request counts; the difference divided by the requests between them is the instructions a request
of the stages so far: exact, and unmoved by other load on the machine (CPU time is not). Used by
bench/tracing_work.py and bench/overload_work.py (`--instructions`).
"""

from __future__ import annotations

import re
import subprocess
import sys


def instructions(script: str, requests: int, upto: str) -> int:
    """Instructions callgrind counts for a whole run of `script` with `requests` requests up to `upto`."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, script,
            "--requests", str(requests), "--rounds", "1", "--upto", upto]
    output = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
    found = re.search(r"I\s+refs:\s+([\d,]+)", output)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind: {output[-500:]}")
    return int(found.group(1).replace(",", ""))


def print_stages(script: str, stages: list[str], small: int = 2000, large: int = 6000) -> int:
    """Prints the instructions a request up to each stage, and each stage's own."""
    print(f"instructions a request, callgrind, ({large} requests - {small}) / {large - small}; stages cumulative:")
    previous = 0.0
    for stage in stages:
        per_request = (instructions(script, large, stage) - instructions(script, small, stage)) / (large - small)
        print(f"  up to {stage:<14} {per_request:9,.0f}   this stage {per_request - previous:+9,.0f}")
        previous = per_request
    return 0
