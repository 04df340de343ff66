"""Runs one scheduled step on the model: packs the batch, one forward, samples per sequence."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tidegate.engine.decode_mirror import context_slots
from tidegate.engine.kv_cache import BLOCK_SIZE
from tidegate.engine.models import LoadedModel
from tidegate.engine.paged_llama import PagedLlama, PrefillSpan, StepInputs
from tidegate.engine.scheduler import ScheduledBatch, ScheduledChunk
from tidegate.engine.sequence import Sequence

__all__ = ["RunnerConfig", "ModelRunner", "DecodeAttention", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class DecodeAttention:
    """What a step's batched decode attention ran over, for the step log: it reads `rows` x
    `positions` of K/V whatever each sequence's own context (the mask hides the rest), so its cost
    follows the longest context, not the summed one."""

    rows: int  # the mirror's rows up to the highest one decoding, or the decodes when gathered
    positions: int  # the longest decode context (mirror), or it rounded up to whole blocks (gather)
    path: str  # "mirror", "gather" (the mirror over its budget) or "" (no decodes)
    copied_positions: int  # K/V positions copied into the mirror first (refills, growth)


NO_DECODES = DecodeAttention(0, 0, "", 0)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    kv_cache_tokens: int
    dtype: str = "fp32"  # a key of DTYPES
    quantize: str | None = None  # "int8" or None
    threads: int | None = None


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: RunnerConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.block_size = BLOCK_SIZE
        num_slots = (config.kv_cache_tokens // BLOCK_SIZE) * BLOCK_SIZE
        with torch.inference_mode():
            self.model = PagedLlama(
                loaded.hf_model, DTYPES[config.dtype], num_slots, loaded.context_tokens, BLOCK_SIZE
            )
            if config.quantize == "int8":
                self.model.quantize_int8()
            else:
                self.model.prepack_fp32()
        self.model.eval()
        self._entropy = random.Random()
        self._threads = config.threads
        self.decode_attention = NO_DECODES  # the last step's

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        if batch.is_empty:
            return []
        if self._threads and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # OpenMP's thread count is per calling thread
        step, sampled_seqs = self._pack(batch)
        logits = self.model(step)
        return self._sample(logits, sampled_seqs)

    def _pack(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        bs = self.block_size
        decodes = batch.chunks[: batch.num_decodes]
        ids: list[int] = [chunk.seq.output_token_ids[-1] for chunk in decodes]
        positions: list[int] = [chunk.start for chunk in decodes]
        slots: list[int] = [chunk.seq.block_table[p // bs] * bs + p % bs for chunk, p in zip(decodes, positions)]
        decode_blocks = decode_mask = None
        mirror_plan = self.model.mirror.plan([(c.seq, c.start, c.seq.block_table) for c in decodes], bs)
        if decodes and mirror_plan is None:
            decode_blocks, decode_mask = self._decode_context(decodes)
            self.decode_attention = DecodeAttention(len(decodes), decode_mask.shape[-1], "gather", 0)
        elif mirror_plan is not None:
            self.decode_attention = DecodeAttention(mirror_plan.num_rows, mirror_plan.length, "mirror",
                                                    self.model.mirror.copied_positions)
        else:
            self.decode_attention = NO_DECODES
        prefills: list[PrefillSpan] = []
        for chunk in batch.chunks[batch.num_decodes :]:
            row = len(ids)
            ids += chunk.seq.token_ids(chunk.start, chunk.num_tokens)
            chunk_positions = range(chunk.start, chunk.start + chunk.num_tokens)
            positions += chunk_positions
            table = chunk.seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in chunk_positions]
            context = None
            if chunk.start > 0:
                context = context_slots(table, chunk.start + chunk.num_tokens, bs)
            prefills.append(PrefillSpan(row, len(ids), chunk.start, context))
        sample_rows, sampled_seqs = [], []
        row = 0
        for chunk in batch.chunks:
            row += chunk.num_tokens
            if chunk.samples:
                sample_rows.append(row - 1)
                sampled_seqs.append(chunk.seq)
        step = StepInputs(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            num_decodes=len(decodes),
            decode_mirror=mirror_plan,
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        )
        return step, sampled_seqs

    def _decode_context(self, decodes: tuple[ScheduledChunk, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([chunk.start + 1 for chunk in decodes])
        width = -(-int(lengths.max()) // self.block_size)
        tables = torch.tensor([(c.seq.block_table + [0] * width)[:width] for c in decodes])  # [B, W]
        mask = torch.arange(width * self.block_size).unsqueeze(0) < lengths.unsqueeze(1)
        return tables, mask[:, None, None, :]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.temperature <= 0:
                continue
            if seq.sampler_state is None:
                seed = params.seed if params.seed is not None else self._entropy.getrandbits(63)
                seq.sampler_state = torch.Generator().manual_seed(seed)
            probs = torch.softmax(logits[row] / params.temperature, dim=-1)
            if params.top_p < 1.0:
                probs = _top_p(probs, params.top_p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=seq.sampler_state))
        return tokens


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(0) - sorted_probs > top_p
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
