"""A Llama-family forward over a paged KV cache: every sequence of a step in one batched pass.

All tokens of a step (one per decoding sequence, plus prefill chunks) are packed into one [T, hidden]
matrix, so every Linear runs once per step for the whole batch; only attention is split: decodes
are batched over the decode mirror's contiguous rows (a padded gather of their KV blocks when the
mirror is over its budget), each prefill chunk attends on its own.
Weights are taken from a transformers model (Llama, Qwen2 and Mistral share this shape; Qwen2 adds
q/k/v biases). q/k/v and gate/up projections are fused to halve the matmul calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidegate.engine.decode_mirror import DecodeMirror, MirrorPlan

__all__ = ["PagedLlama", "StepInputs", "PrefillSpan", "PrepackedLinear"]


@dataclass(frozen=True)
class PrefillSpan:
    row_start: int  # rows [row_start, row_end) of the packed step hold this chunk
    row_end: int
    context_start: int  # position of the chunk's first token; earlier positions are in the cache
    context_slots: torch.Tensor | None  # cache slots of positions [0, context_start + len); None if start 0


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_mirror: MirrorPlan | None  # decodes attend over the mirror's rows; else over a gather of:
    decode_blocks: torch.Tensor | None  # [B, W] KV blocks of each decode's context, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where the slot is part of the context
    prefills: tuple[PrefillSpan, ...]
    sample_rows: torch.Tensor  # [N] rows whose logits are needed


class _Layer(nn.Module):
    def __init__(self, hf_layer: Any, dtype: torch.dtype) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
        self.o = _fuse([attn.o_proj], dtype)
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj], dtype)
        self.down = _fuse([mlp.down_proj], dtype)
        self.input_norm = nn.Parameter(hf_layer.input_layernorm.weight.detach().to(dtype), requires_grad=False)
        self.post_norm = nn.Parameter(
            hf_layer.post_attention_layernorm.weight.detach().to(dtype), requires_grad=False
        )


def _fuse(linears: list[nn.Linear], dtype: torch.dtype) -> nn.Linear:
    has_bias = any(lin.bias is not None for lin in linears)
    out_features = sum(lin.out_features for lin in linears)
    fused = nn.Linear(linears[0].in_features, out_features, bias=has_bias, dtype=dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if has_bias:
            fused.bias.copy_(
                torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears])
            )
    if dtype is torch.float32:
        # stored [in, out], seen through a transposed view: F.linear then multiplies by a contiguous
        # matrix, which MKL ran ~8 % faster per fp32 decode step here (same tokens); bf16 gained
        # nothing and its rounding changed, so it keeps nn.Linear's layout
        fused.weight = nn.Parameter(fused.weight.detach().t().contiguous().t(), requires_grad=False)
    fused.requires_grad_(False)
    return fused


class PrepackedLinear(nn.Module):
    """An fp32 Linear whose weight oneDNN has reordered once into its own blocked layout.

    Plain F.linear repacks the weight on every call; for a batched decode (8-64 rows) that repacking
    is a large part of the matmul. Measured here (2 threads, 32-row decode step of
    tiny-random-llama): the whole step ran ~17 % faster. With fewer rows the reordered kernel was
    slower than MKL's (1 row: +30 %), so small batches keep the plain weight; both are kept, which
    doubles fp32 weight memory. Results differ from F.linear only in summation order (~5e-6
    relative); greedy tokens matched generate() in tests/engine/test_model_loading.py.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = 8, expected_rows: int = 32) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = min_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), expected_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_prepack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PagedLlama(nn.Module):
    def __init__(
        self, hf_model: Any, dtype: torch.dtype, num_cache_slots: int, max_positions: int, block_size: int
    ) -> None:
        super().__init__()
        self.block_size = block_size
        config = hf_model.config
        self.hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        body = hf_model.model
        self.embed = nn.Parameter(body.embed_tokens.weight.detach().to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(layer, dtype) for layer in body.layers)
        self.norm = nn.Parameter(body.norm.weight.detach().to(dtype), requires_grad=False)
        self.lm_head = _fuse([hf_model.lm_head], dtype)
        with torch.inference_mode():
            # the model's own rotary module, so rope scaling variants match the reference exactly
            probe = torch.zeros(1, dtype=torch.float32)
            cos, sin = body.rotary_emb(probe, torch.arange(max_positions).unsqueeze(0))
        self.register_buffer("cos", cos[0].to(dtype).unsqueeze(1), persistent=False)  # [P, 1, D]
        self.register_buffer("sin", sin[0].to(dtype).unsqueeze(1), persistent=False)
        cache_shape = (len(self.layers), num_cache_slots, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=dtype)
        self.v_cache = torch.zeros(cache_shape, dtype=dtype)
        # at most as many tokens again as the paged cache
        self.mirror = DecodeMirror(len(self.layers), self.num_kv_heads, self.head_dim, dtype, num_cache_slots)

    def attention_cost_tokens(self) -> int:
        """Context length at which one token's attention flops (QK and PV) equal its Linear flops."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        intermediate = self.layers[0].down.in_features
        linear = self.hidden * (q_width + 2 * kv_width) + q_width * self.hidden + 3 * self.hidden * intermediate
        return round(linear / (2 * q_width))  # per context position: 2 multiply-adds per head dim

    def quantize_int8(self) -> None:
        """Dynamic int8 quantisation of the decoder Linears (weights int8, activations per batch)."""
        from torch.ao.quantization import quantize_dynamic

        if self.dtype is not torch.float32:
            raise ValueError("int8 dynamic quantisation needs fp32 activations: use --dtype fp32")
        self.layers = quantize_dynamic(self.layers, {nn.Linear}, dtype=torch.qint8)

    def prepack_fp32(self) -> None:
        """Swaps every fp32 decoder Linear for a PrepackedLinear (the lm_head too)."""
        if self.dtype is not torch.float32 or not can_prepack():
            return
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                linear = getattr(layer, name)
                if type(linear) is nn.Linear:  # a quantized layer is left alone
                    setattr(layer, name, PrepackedLinear(linear))
        self.lm_head = PrepackedLinear(self.lm_head)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Returns fp32 logits [N, vocab] for `step.sample_rows`."""
        x = F.embedding(step.input_ids, self.embed)
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            q, k, v = layer.qkv(h).split((q_width, kv_width, kv_width), dim=-1)
            q = _rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
            k = _rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            self.k_cache[index].index_copy_(0, step.slot_mapping, k)
            self.v_cache[index].index_copy_(0, step.slot_mapping, v)
            attended = self._attention(index, step, q, k, v)
            x = x + layer.o(attended)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        last = F.rms_norm(x[step.sample_rows], (self.hidden,), self.norm, self.eps)
        return self.lm_head(last).float()

    def _attention(self, index: int, step: StepInputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype)
        batch = step.num_decodes
        if batch and step.decode_mirror is not None:
            out[:batch] = self._mirror_attention(index, step.decode_mirror, q[:batch], k[:batch], v[:batch])
        elif batch:
            group = self.num_heads // self.num_kv_heads
            # the query heads sharing a KV head act as `group` query rows: GQA without repeating K/V
            queries = q[:batch].view(batch, self.num_kv_heads, group, self.head_dim)
            keys = self._gather_blocks(self.k_cache[index], step.decode_blocks)  # [B, KV, L, D]
            values = self._gather_blocks(self.v_cache[index], step.decode_blocks)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=step.decode_mask)
            out[:batch] = attended.reshape(batch, -1)
        for span in step.prefills:
            rows = slice(span.row_start, span.row_end)
            queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, C, D]
            if span.context_slots is None:
                keys, values, mask, causal = k[rows], v[rows], None, True
            else:
                keys = self.k_cache[index].index_select(0, span.context_slots)
                values = self.v_cache[index].index_select(0, span.context_slots)
                length = span.row_end - span.row_start
                positions = torch.arange(span.context_start, span.context_start + length).unsqueeze(1)
                mask, causal = torch.arange(keys.shape[0]).unsqueeze(0) <= positions, False
            attended = F.scaled_dot_product_attention(
                queries,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=True,
            )
            out[rows] = attended[0].transpose(0, 1).reshape(span.row_end - span.row_start, -1)
        return out

    def _mirror_attention(
        self, index: int, plan: MirrorPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        mirror_k, mirror_v = self.mirror.k[index], self.mirror.v[index]  # [rows, length, KV, D]
        for row, slots in plan.refills:
            mirror_k[row, : len(slots)] = self.k_cache[index].index_select(0, slots)
            mirror_v[row, : len(slots)] = self.v_cache[index].index_select(0, slots)
        mirror_k.index_put_((plan.rows, plan.positions), k)
        mirror_v.index_put_((plan.rows, plan.positions), v)
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        queries = q.view(batch, self.num_kv_heads, group, self.head_dim)
        if not plan.in_order:
            queries = queries.new_zeros(plan.num_rows, *queries.shape[1:]).index_copy_(0, plan.rows, queries)
        keys = mirror_k[: plan.num_rows, : plan.length].transpose(1, 2)  # a view: [R, KV, L, D]
        values = mirror_v[: plan.num_rows, : plan.length].transpose(1, 2)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask)
        if not plan.in_order:
            attended = attended.index_select(0, plan.rows)
        return attended.reshape(batch, -1)

    def _gather_blocks(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Copies whole blocks (index_select of 16-token rows): ~10x faster here than gathering
        single slots with advanced indexing, which took 40 % of a 32-sequence decode step."""
        batch, width = blocks.shape
        paged = cache.view(-1, self.block_size, self.num_kv_heads, self.head_dim)
        gathered = paged.index_select(0, blocks.flatten())
        return gathered.view(batch, width * self.block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
