"""The real MiniLM: fidelity against sentence-transformers, token counts, model detection."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tidegate.engine.embeddings import EmbeddingModel, is_embedding_model, resolve_model_dir

# varied on purpose: short, long (past the 256-token window), unicode, code, numbers, padding-heavy
SENTENCES = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Quantum entanglement links the states of two particles across any distance.",
    "def add(a, b):\n    return a + b",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "Il pleut des cordes depuis ce matin à Paris.",
    "東京は日本の首都です。",
    "Эмбеддинги — это векторы чисел.",
    "🙂🚀 emojis and symbols: ∑ ∫ √ ≠",
    "3.14159 2.71828 1.41421 1729 42",
    "   leading and trailing spaces   ",
    "UPPER CASE SHOUTING ABOUT THE WEATHER",
    "The stock market fell sharply after the central bank raised interest rates by half a point.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I'd like to cancel my subscription, please refund the last payment.",
    "a",
    " ".join(["tokens and more tokens"] * 120),  # ~480 words: truncated at 256 tokens
    "Dynamic batching groups requests so the CPU computes them together.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_model_dir("all-MiniLM-L6-v2")), device="cpu")
    return model.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)


@pytest.fixture(scope="module")
def fp32_model() -> EmbeddingModel:
    return EmbeddingModel.load("all-MiniLM-L6-v2", dtype="fp32")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_matches_sentence_transformers(dtype: str, reference: np.ndarray, fp32_model: EmbeddingModel) -> None:
    model = fp32_model if dtype == "fp32" else EmbeddingModel.load("all-MiniLM-L6-v2", dtype=dtype)
    cosines = (model.embed(SENTENCES) * reference).sum(axis=1)
    assert cosines.min() >= 0.999, f"{dtype}: min cosine {cosines.min():.5f}"


def test_embeddings_are_unit_float32(fp32_model: EmbeddingModel) -> None:
    vectors = fp32_model.embed(SENTENCES[:3])
    assert vectors.dtype == np.float32 and vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_batch_padding_does_not_change_a_vector(fp32_model: EmbeddingModel) -> None:
    alone = fp32_model.embed(["A man is eating food."])[0]
    padded = fp32_model.embed(["A man is eating food.", SENTENCES[14]])[0]
    assert float(alone @ padded) > 0.99999


def test_token_counts_include_specials_and_truncate(fp32_model: EmbeddingModel) -> None:
    assert fp32_model.count_tokens(["hello", SENTENCES[18]]) == [3, fp32_model.max_tokens]


def test_minilm_shape(fp32_model: EmbeddingModel) -> None:
    assert (fp32_model.name, fp32_model.dimensions, fp32_model.max_tokens) == ("all-MiniLM-L6-v2", 384, 256)


def test_int8_runs_and_stays_roughly_close(fp32_model: EmbeddingModel) -> None:
    """int8 is lossy on MiniLM (reported by the bench); this only guards against a broken model."""
    int8 = EmbeddingModel.load("all-MiniLM-L6-v2", quantize="int8")
    cosines = (int8.embed(SENTENCES) * fp32_model.embed(SENTENCES)).sum(axis=1)
    assert int8.precision == "int8" and cosines.mean() > 0.9


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "ALL-minilm-l6-v2"])
def test_builtin_names_are_embedding_models(name: str) -> None:
    assert is_embedding_model(name)


def test_sentence_transformers_directory_is_an_embedding_model() -> None:
    assert is_embedding_model(str(resolve_model_dir("all-MiniLM-L6-v2")))


def test_causal_lm_directory_is_not(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "modules.json").write_text("[]")
    assert not is_embedding_model(str(tmp_path))


@pytest.mark.parametrize("name", ["tiny-random-llama", "/nonexistent/dir"])
def test_other_names_are_not(name: str) -> None:
    assert not is_embedding_model(name)


@pytest.mark.parametrize("options", [{"dtype": "fp16"}, {"quantize": "int4"}])
def test_unsupported_precision_is_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        EmbeddingModel.load("all-MiniLM-L6-v2", **options)


def test_builtin_model_answers_to_both_names(fp32_model: EmbeddingModel) -> None:
    assert set(fp32_model.aliases) == {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}


def test_importing_embeddings_does_not_import_torch() -> None:
    code = "import sys, tidegate.engine.embeddings_api; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
