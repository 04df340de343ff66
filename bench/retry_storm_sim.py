"""`bench/retry_storm.py`'s storm in the simulator: the same clients (closed loop, resend at once),
prompts and answer lengths, on the shipped `tiny-random-llama-cpu` profile (the embedded engine,
fitted on its own steps), two replicas, the controller `tidegate serve` builds for the embedded
default, against FIFO. Prints per arm, mean of three seeds: completed, completed within the
standard tier's TTFT target, refusals, replicas busy. Each refusal's round trip takes
`--refusal-cpu-us` of CPU from the replicas' cores, as it does live where the gateway, the clients
and the engines share a machine (`tidegate.sim.scenarios.SHARED_CORES_REFUSAL_CPU_S`; 0: the
gateway and its clients on cores of their own). docs/overload-knobs.md compares it with the live run.
The prompt is the storm's as the engine counts it (the chat template adds 19 tokens to its 250
bytes), and every request sends the same one, which the engines' prefix cache computes once (13 of
its 269 tokens a request): `--distinct-prompts` gives each request its own, as engines started with
`--no-prefix-caching` compute them. bench/storm_fidelity.py runs the two side by side.

Run: python bench/retry_storm_sim.py [--storm-s 40] [--prompt 250] [--output 32] [--refusal-cpu-us 190]
     [--distinct-prompts]
"""

from __future__ import annotations

import argparse

from tidegate.loadgen.mix import LengthDistribution
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import ClosedLoopClients, Harness, TrafficClass
from tidegate.sim.scenarios import SHARED_CORES_REFUSAL_CPU_S
from tidegate.simulate import Simulation, pool_controller

SEEDS = (1, 2, 3)
# what the embedded engine's chat template adds to a user message, in its byte tokenizer's tokens:
# <|im_start|> "user\n" ... <|im_end|> "\n" <|im_start|> "assistant\n"
CHAT_TEMPLATE_TOKENS = 19


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm-s", type=float, default=40.0)
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--refusal-cpu-us", type=float, default=SHARED_CORES_REFUSAL_CPU_S * 1e6,
                        help="CPU a refusal's round trip takes from the replicas' cores, in microseconds")
    parser.add_argument("--distinct-prompts", action="store_true",
                        help="each request its own prompt (engines without prefix caching)")
    args = parser.parse_args()
    sim = Simulation(replicas=2)
    prompt = args.prompt + CHAT_TEMPLATE_TOKENS
    traffic = TrafficClass("t1", "standard", 1.0, LengthDistribution("const", prompt),
                           LengthDistribution("const", args.output),
                           shared_prefix_tokens=0 if args.distinct_prompts else prompt)
    target_s = sim.tiers["standard"].ttft_target_s
    print(f"profile {sim.profile.name}, 2 replicas, slot_limit {sim.slot_limit}; prompts {prompt} tokens "
          f"({'each its own' if args.distinct_prompts else 'one prompt, cached'}), "
          f"{args.output} answered; storm {args.storm_s:.0f} s; TTFT target {target_s:.0f} s; a refusal takes "
          f"{args.refusal_cpu_us:.0f} us of the replicas' CPU; mean of {len(SEEDS)} seeds")
    for clients in (64, 512):
        for arm in ("fifo", "tidegate"):
            completed = good = refused = 0
            busy = []
            for seed in SEEDS:
                dispatcher = (FifoDispatcher(sim.replica_ids, sim.tiers, slot_limit=sim.slot_limit) if arm == "fifo"
                              else pool_controller(sim.config, sim.pool.name, sim.replica_ids)[0])
                harness = Harness([sim.profile.spec(i) for i in sim.replica_ids], dispatcher,
                                  refusal_cpu_s=args.refusal_cpu_us * 1e-6)
                storm = ClosedLoopClients(clients, traffic, 0.0, args.storm_s, resend_s=0.002, seed=seed)
                result = harness.run((), clients=storm, probes_s=(2.0, args.storm_s))
                done = [r for r in result.records if r.finish_s is not None and r.finish_s < args.storm_s]
                completed += len(done)
                good += sum(1 for r in done if r.ttft_s is not None and r.ttft_s <= target_s)
                refused += sum(1 for r in result.records if r.refused_reason is not None)
                busy.append(result.busy_fraction(2.0, args.storm_s))
            n = len(SEEDS)
            print(f"  {clients:4d} clients {arm:8s} completed {completed / n:6.1f}  within target {good / n:6.1f}  "
                  f"refused {refused / n:9,.0f}  replicas busy {100 * min(busy):3.0f} %", flush=True)


if __name__ == "__main__":
    main()
