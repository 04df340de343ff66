"""The real loading code on small random models that the test saves with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence


def _save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the sea and the ship", "a story about a ship at sea"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(directory)


def _save_model(directory: Path, family: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0)
    config_type, model_type = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(1)
    model = model_type(config_type(**shape))
    with torch.no_grad():  # larger weights than the default init, so greedy tokens are not near-ties
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)


def _engine_greedy(runner: ModelRunner, prompt: list[int], max_tokens: int, chunk: int) -> list[int]:
    return _engine_greedy_batch(runner, [prompt], max_tokens, chunk)[0]


def _engine_greedy_batch(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, chunk: int) -> list[list[int]]:
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=chunk), BlockManager(1024))
    seqs = [Sequence(seq_id=i, prompt_token_ids=prompt, params=SamplingParams(max_tokens, temperature=0, ignore_eos=True))
            for i, prompt in enumerate(prompts, start=1)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work:
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch))
    return [seq.output_token_ids for seq in seqs]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_saved_model_loads_and_engine_matches_transformers_greedy(tmp_path: Path, family: str) -> None:
    _save_model(tmp_path, family)
    _save_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    prompt = loaded.tokenizer.encode("a story about the sea")
    runner = ModelRunner(loaded, RunnerConfig(kv_cache_tokens=1024))
    with torch.inference_mode():
        reference = loaded.hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                                             do_sample=False)[0, len(prompt):].tolist()
    # a chunk of 3 tokens makes the prompt span several prefill steps
    assert _engine_greedy(runner, prompt, 10, chunk=3) == reference


@pytest.mark.parametrize("mirror_budget_tokens", [0, 1 << 16], ids=["gathered-kv", "mirrored-kv"])
def test_staggered_batch_matches_transformers_greedy(tmp_path: Path, mirror_budget_tokens: int) -> None:
    # 12 sequences of different lengths arrive in two waves and finish at different steps, so decode
    # batches grow and shrink, rows are freed and reused out of order, and every Linear sees >= 8 rows
    # (the prepacked path), and rows freed below live ones take the highest live rows' K/V; each
    # sequence's tokens must still be the ones generate() gives it alone.
    # A budget of 0 turns the decode mirror off: attention then gathers the paged blocks.
    _save_model(tmp_path, "llama")
    _save_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded, RunnerConfig(kv_cache_tokens=1024))
    runner.model.mirror.budget_tokens = mirror_budget_tokens
    moves: list = []  # rows moved down into freed ones (`MirrorRows`): their copied K/V must serve as before
    rows = runner.model.mirror._rows
    release_absent = rows.release_absent

    def counted_release(present: object) -> list:
        step_moves = release_absent(present)
        moves.extend(step_moves)
        return step_moves

    rows.release_absent = counted_release
    prompts = [loaded.tokenizer.encode(f"the ship {'and the sea ' * (i % 4)}story {i}") for i in range(12)]
    lengths = [4 + (i * 5) % 11 for i in range(12)]
    references = []
    with torch.inference_mode():
        for prompt, length in zip(prompts, lengths):
            output = loaded.hf_model.generate(torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length,
                                              do_sample=False)
            references.append(output[0, len(prompt):].tolist())
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=64), BlockManager(1024))
    seqs = [Sequence(seq_id=i, prompt_token_ids=prompt, params=SamplingParams(length, temperature=0, ignore_eos=True))
            for i, (prompt, length) in enumerate(zip(prompts, lengths), start=1)]
    for seq in seqs[:8]:
        scheduler.add(seq)
    for step in range(1000):
        if step == 6:
            for seq in seqs[8:]:
                scheduler.add(seq)
        if not scheduler.has_work and step > 6:
            break
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch))
    assert [seq.output_token_ids for seq in seqs] == references
    if mirror_budget_tokens:
        assert runner.model.mirror.capacity[0] >= 8  # the mirror did serve these decodes
        assert moves  # and moved rows


def test_saved_tokenizer_round_trips_text(tmp_path: Path) -> None:
    _save_model(tmp_path, "llama")
    _save_tokenizer(tmp_path)
    tokenizer = load_model(str(tmp_path)).tokenizer
    decoder = tokenizer.decoder()
    assert "".join(decoder.push(t) for t in tokenizer.encode("the ship at sea")) == "the ship at sea"


@pytest.mark.parametrize("rows", [1, 7, 8, 32, 100])
def test_prepacked_linear_matches_plain_linear(rows: int) -> None:
    from torch import nn

    from tidegate.engine.paged_llama import PrepackedLinear, can_prepack

    if not can_prepack():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        expected = linear(x)
        assert torch.allclose(PrepackedLinear(linear)(x), expected, rtol=1e-5, atol=1e-5)
