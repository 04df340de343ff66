"""Assembles a generation engine from options: model, runner, block manager, scheduler, loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.loop import EngineLoop
from tidegate.engine.metrics import EngineMetrics
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence
from tidegate.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tidegate.engine.server import EngineOptions

__all__ = ["BuiltEngine", "DEFAULT_GENERATION_DTYPE", "build_generation_engine"]

# fp32 by default; lossy settings are opt-in only. bench/engine_quantize_generation.py, 2 threads,
# 16 streams: bf16 1.69x fp32's tokens/s but 93.0 % greedy-token agreement; int8 1.96x, 64.5 %.
DEFAULT_GENERATION_DTYPE = "fp32"


@dataclass(frozen=True)
class BuiltEngine:
    loop: EngineLoop
    tokenizer: Tokenizer
    served_model_name: str
    max_total_tokens: int  # prompt + completion of one request
    model_card: dict[str, Any]


def build_generation_engine(options: EngineOptions, metrics: EngineMetrics | None = None) -> BuiltEngine:
    loaded = load_model(options.model)
    dtype = options.dtype or DEFAULT_GENERATION_DTYPE
    if options.quantize == "int8":
        dtype = "fp32"  # dynamic int8 Linears take fp32 activations
    runner = ModelRunner(
        loaded,
        RunnerConfig(
            kv_cache_tokens=options.kv_cache_tokens, dtype=dtype, quantize=options.quantize, threads=options.threads
        ),
    )
    blocks = BlockManager(options.kv_cache_tokens)
    if metrics is not None:
        metrics.kv_capacity.set(blocks.capacity_tokens)
    config = SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_batch_tokens=options.max_batch_tokens,
        chunked_prefill=options.chunked_prefill,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        attention_cost_tokens=runner.model.attention_cost_tokens(),
        enable_prefix_caching=options.enable_prefix_caching,
    )
    _warm_up(runner, config, options.kv_cache_tokens)
    max_total_tokens = min(loaded.context_tokens, blocks.capacity_tokens)
    card = {
        "description": loaded.description,
        "max_model_len": max_total_tokens,
        "dtype": dtype,
        "quantize": options.quantize,
        # the scheduler's limits, for `tidegate sim calibrate` (and anyone sizing a pool)
        "max_num_seqs": config.max_num_seqs,
        "max_batch_tokens": config.max_batch_tokens,
        "kv_cache_tokens": blocks.capacity_tokens,
        "attention_cost_tokens": config.attention_cost_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
    }
    return BuiltEngine(EngineLoop(Scheduler(config, blocks), runner, metrics), loaded.tokenizer, loaded.name,
                       max_total_tokens, card)


def _warm_up(runner: ModelRunner, config: SchedulerConfig, kv_cache_tokens: int) -> None:
    """One prefill and one decode before serving: the first forward pass initialises kernels."""
    scheduler = Scheduler(config, BlockManager(kv_cache_tokens))
    scheduler.add(Sequence(seq_id=0, prompt_token_ids=[1] * 8, params=SamplingParams(max_tokens=2, ignore_eos=True)))
    while scheduler.has_work:
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch))
