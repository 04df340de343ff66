"""The simulator: the second body that drives the same pure policies on virtual time.

loop (events, virtual clock), replica (the engine's scheduler + a step cost model), seam (the
dispatcher contract), fifo (the baseline dispatcher), harness (scenario runner), report (summary).
Deterministic: no asyncio, no wall clock, every draw from a seeded generator.
"""
