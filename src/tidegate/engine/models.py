"""Model presets and loading: the built-in random preset, or a local Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tidegate.errors import NotFoundError

__all__ = ["LoadedModel", "PRESETS", "SUPPORTED_ARCHITECTURES", "load_model", "tiny_random_llama_config"]

SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen2", "mistral"})
TINY_RANDOM_LLAMA = "tiny-random-llama"
PRESETS = {
    TINY_RANDOM_LLAMA: "about 40 M parameters, random weights (fixed seed): real compute, meaningless text",
}
_PRESET_SEED = 0


@dataclass(frozen=True)
class LoadedModel:
    name: str  # the served model name
    hf_model: Any  # a transformers causal LM in eval mode (fp32)
    tokenizer: Tokenizer
    context_tokens: int  # longest prompt + completion the model's positions allow
    description: str


def tiny_random_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ByteTokenizer.END_OF_TEXT,
        pad_token_id=ByteTokenizer.END_OF_TEXT,
    )


def _build_tiny_random_llama() -> LoadedModel:
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(_PRESET_SEED)
        model = LlamaForCausalLM(tiny_random_llama_config())
    return LoadedModel(
        name=TINY_RANDOM_LLAMA,
        hf_model=model.eval(),
        tokenizer=ByteTokenizer(),
        context_tokens=model.config.max_position_embeddings,
        description=PRESETS[TINY_RANDOM_LLAMA],
    )


def _generation_eos_ids(model_dir: Path) -> frozenset[int]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return frozenset()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def _load_directory(model_dir: Path) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise NotFoundError(
            f"model type {config.model_type!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}",
            param="model",
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return LoadedModel(
        name=model_dir.name,
        hf_model=model.eval(),
        tokenizer=HFTokenizer(str(model_dir), extra_eos_ids=_generation_eos_ids(model_dir)),
        context_tokens=int(config.max_position_embeddings),
        description=f"{config.model_type} loaded from a local directory",
    )


def load_model(name_or_dir: str) -> LoadedModel:
    if name_or_dir in PRESETS:
        return _build_tiny_random_llama()
    path = Path(name_or_dir)
    if (path / "config.json").exists():
        return _load_directory(path)
    raise NotFoundError(
        f"model {name_or_dir!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json",
        param="model",
    )
