"""The semantic cache's core: the index (scopes, threshold, guard, LRU, snapshot) on synthetic
vectors, the guard on hand-picked pairs, and the hit rule with the real MiniLM on the shipped set."""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from importlib import resources

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.cache.semantic import (
    DEFAULT_SIMILARITY_THRESHOLD,
    SemanticEntry,
    SemanticIndex,
    answer_tokens,
    answer_tokens_match,
)

DIM = 8
QUESTION = "How do I reverse a list in Python?"


def unit(*values: float) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[: len(values)] = values
    return vector / np.linalg.norm(vector)


def axis(i: int) -> np.ndarray:
    """The unit vector along axis `i`: distinct axes are orthogonal questions (cosine 0)."""
    vector = np.zeros(DIM, dtype=np.float32)
    vector[i] = 1.0
    return vector


def tilted(base: np.ndarray, cosine: float, towards: int = DIM - 1) -> np.ndarray:
    """A unit vector at exactly `cosine` from `base` (a unit vector orthogonal to axis `towards`)."""
    other = np.zeros(DIM, dtype=np.float32)
    other[towards] = 1.0
    return (cosine * base + np.sqrt(1 - cosine**2) * other).astype(np.float32)


# ------------------------------------------------------------------------------------------ the index

def test_lookup_finds_a_similar_question_of_its_scope() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("scope-a", axis(0), QUESTION, "answer-1")
    hit = index.lookup("scope-a", tilted(axis(0), 0.95), "What's the way to reverse a Python list?", 0.9)
    assert hit is not None
    assert hit.entry_key == "answer-1"
    assert hit.similarity == pytest.approx(0.95, abs=1e-5)


def test_no_hit_across_scopes() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("tenant-a/model-x", axis(0), QUESTION, "answer-a")
    assert index.lookup("tenant-b/model-x", axis(0), QUESTION, 0.5) is None


def test_a_question_just_under_the_threshold_misses() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", axis(0), QUESTION, "answer-1")
    assert index.lookup("s", tilted(axis(0), 0.89), QUESTION, threshold=0.9) is None
    assert index.lookup("s", tilted(axis(0), 0.91), QUESTION, threshold=0.9) is not None


def test_lookup_takes_the_most_similar_entry() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", tilted(axis(0), 0.92, towards=6), QUESTION, "further")
    index.add("s", tilted(axis(0), 0.99, towards=5), QUESTION, "closest")
    index.add("s", tilted(axis(0), 0.95, towards=4), QUESTION, "middle")
    assert index.lookup("s", axis(0), QUESTION, 0.9).entry_key == "closest"


def test_lookup_passes_over_a_closer_entry_the_guard_rejects() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", tilted(axis(0), 0.99, towards=6), "What is 25% of 200?", "other-number")
    index.add("s", tilted(axis(0), 0.93, towards=5), "Calculate 15 percent of 200.", "same-question")
    hit = index.lookup("s", axis(0), "What is 15% of 200?", 0.9)
    assert hit is not None and hit.entry_key == "same-question"


def test_no_hit_when_only_guard_rejected_entries_are_similar() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", axis(0), "What is 25% of 200?", "other-number")
    assert index.lookup("s", axis(0), "What is 15% of 200?", 0.9) is None


def test_vectors_are_normalised_on_the_way_in() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", 3.0 * unit(1, 1), QUESTION, "k")
    assert index.lookup("s", 0.5 * unit(1, 1), QUESTION, 0.99).similarity == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("vector", [np.zeros(DIM), np.ones(DIM + 1), np.full(DIM, np.nan)])
def test_a_vector_of_the_wrong_size_or_no_direction_is_refused(vector: np.ndarray) -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    with pytest.raises(ValueError):
        index.add("s", vector, QUESTION, "k")


def test_add_evicts_the_least_recently_used_and_says_which() -> None:
    index = SemanticIndex(max_entries=2, dim=DIM)
    assert index.add("s", axis(0), QUESTION, "first") == ()
    assert index.add("t", axis(1), QUESTION, "second") == ()
    assert index.add("s", axis(2), QUESTION, "third") == ("first",)
    assert "first" not in index and len(index) == 2
    assert index.lookup("s", axis(0), QUESTION, 0.9) is None


def test_a_lookup_does_not_refresh_recency_but_touch_does() -> None:
    index = SemanticIndex(max_entries=2, dim=DIM)
    index.add("s", axis(0), QUESTION, "first")
    index.add("s", axis(1), QUESTION, "second")
    assert index.lookup("s", axis(0), QUESTION, 0.9).entry_key == "first"
    assert index.add("s", axis(2), QUESTION, "third") == ("first",)  # the lookup changed nothing
    assert index.touch("second")
    assert index.add("s", axis(3), QUESTION, "fourth") == ("third",)  # "second" was served: kept


def test_touch_and_remove_of_an_unknown_key_say_so() -> None:
    index = SemanticIndex(max_entries=2, dim=DIM)
    assert not index.touch("missing")
    assert not index.remove("missing")


def test_remove_forgets_one_entry_and_keeps_the_others_findable() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    for i in range(4):
        index.add("s", axis(i), QUESTION, f"key-{i}")
    assert index.remove("key-0")  # the last row moves into its place
    assert index.lookup("s", axis(0), QUESTION, 0.9) is None
    for i in range(1, 4):
        assert index.lookup("s", axis(i), QUESTION, 0.9).entry_key == f"key-{i}"


def test_the_last_entry_of_a_scope_takes_the_scope_with_it() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("s", axis(0), QUESTION, "only")
    index.remove("only")
    assert index.scope_count == 0 and len(index) == 0


def test_adding_an_existing_key_replaces_its_entry() -> None:
    index = SemanticIndex(max_entries=10, dim=DIM)
    index.add("old-scope", axis(0), QUESTION, "k")
    index.add("new-scope", axis(1), QUESTION, "k")
    assert len(index) == 1
    assert index.lookup("old-scope", axis(0), QUESTION, 0.9) is None
    assert index.lookup("new-scope", axis(1), QUESTION, 0.9).entry_key == "k"


def test_a_scope_grows_past_its_first_rows_and_shrinks_back() -> None:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((50, DIM)).astype(np.float32)
    index = SemanticIndex(max_entries=100, dim=DIM)
    for i, vector in enumerate(vectors):
        index.add("s", vector, QUESTION, f"k{i}")
    for i in range(45):
        index.remove(f"k{i}")
    for i in range(45, 50):
        assert index.lookup("s", vectors[i], QUESTION, 0.9999).entry_key == f"k{i}"


def test_snapshot_and_restore_keep_entries_and_their_recency() -> None:
    index = SemanticIndex(max_entries=3, dim=DIM)
    index.add("s", axis(0), "What is 15% of 200?", "a")
    index.add("t", axis(1), QUESTION, "b")
    index.add("s", axis(2), QUESTION, "c")
    index.touch("a")
    entries = index.snapshot()
    assert [e.entry_key for e in entries] == ["b", "c", "a"]
    assert all(len(e.vector) == 4 * DIM for e in entries)

    restored = SemanticIndex(max_entries=3, dim=DIM)
    assert restored.restore(entries) == ()
    assert restored.lookup("s", axis(0), "Calculate 15 percent of 200.", 0.9).entry_key == "a"
    assert restored.lookup("s", axis(0), "What is 25% of 200?", 0.9) is None  # the text came back too
    assert restored.add("t", axis(3), QUESTION, "d") == ("b",)


def test_restore_into_a_smaller_index_keeps_the_most_recent() -> None:
    entries = [SemanticEntry(scope="s", entry_key=f"k{i}", text=QUESTION, vector=axis(i).tobytes())
               for i in range(4)]
    index = SemanticIndex(max_entries=2, dim=DIM)
    assert index.restore(entries) == ("k0", "k1")
    assert [e.entry_key for e in index.snapshot()] == ["k2", "k3"]


operations = st.lists(st.tuples(st.sampled_from(["add", "remove", "touch", "lookup"]),
                                st.integers(0, 5),  # entry key
                                st.integers(0, 1),  # scope
                                st.integers(0, 2**31)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_the_index_answers_as_a_brute_force_search_over_live_entries(ops: list[tuple[str, int, int, int]]) -> None:
    index = SemanticIndex(max_entries=4, dim=DIM)
    model: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()  # key -> (scope, unit vector)
    for op, key_number, scope_number, seed in ops:
        key, scope = f"k{key_number}", f"s{scope_number}"
        vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
        vector /= np.linalg.norm(vector)
        if op == "add":
            model.pop(key, None)
            model[key] = (scope, vector)
            expected_evicted = []
            while len(model) > 4:
                expected_evicted.append(model.popitem(last=False)[0])
            assert index.add(scope, vector, QUESTION, key) == tuple(expected_evicted)
        elif op == "remove":
            assert index.remove(key) == (model.pop(key, None) is not None)
        elif op == "touch":
            assert index.touch(key) == (key in model)
            if key in model:
                model.move_to_end(key)
        else:
            scored = [(float(v @ vector), k) for k, (s, v) in model.items() if s == scope]
            best = max(scored, default=None)
            hit = index.lookup(scope, vector, QUESTION, threshold=0.3)
            if best is None or best[0] < 0.3:
                assert hit is None
            else:
                assert hit is not None and hit.similarity == pytest.approx(best[0], abs=1e-5)
        snapshot = index.snapshot()
        assert [e.entry_key for e in snapshot] == list(model)
        for entry in snapshot:
            assert entry.scope == model[entry.entry_key][0]
            assert np.allclose(np.frombuffer(entry.vector, "<f4"), model[entry.entry_key][1], atol=1e-6)


# ------------------------------------------------------------------------------------------ the guard

SAME_ANSWER = [
    # numbers: written differently, the same value
    ("How many grams are in 2,000 kilograms?", "2000 kg is how many grams?"),
    ("What is two plus two?", "What's 2 + 2?"),
    ("What is 15% of 200?", "Calculate 15 percent of 200."),
    ("How much is 5 dollars in euros?", "Convert $5 to euros."),
    ("What is the 3rd planet from the Sun?", "What is the third planet from the Sun?"),
    ("I was charged twice this month", "I was charged two times this month"),
    ("What's the average of 10, 20 and 30?", "What's the average of 30, 20 and 10?"),
    # units: "a" / "one" / "1" before a unit is the unit alone; aliases and rates
    ("How many ounces are in a cup?", "How many oz are in one cup?"),
    ("What is 60 km per hour in mph?", "60 km/h is how many mph?"),
    ("How long should I boil an egg?", "How many minutes should I boil an egg?"),
    # negation: contractions
    ("Why doesn't my code compile?", "Why does my code not compile?"),
    ("Why can't I log in?", "Why am I unable to log in?"),
    # names: case and possessives; a name one side adds
    ("what is the capital of italy", "What's Italy's capital city?"),
    ("What's the tallest mountain in the world?", "Which mountain is the highest on Earth?"),
    # dates: plural weekdays; "May I" is not the month
    ("Is it cheaper to fly on Tuesdays?", "Is flying cheaper on a Tuesday?"),
    ("May I bring my dog?", "Can I bring my dog?"),
    # comparison: synonyms, and "less" + adjective
    ("What is the largest planet?", "Which planet is the biggest?"),
    ("Are flights cheaper on weekdays?", "Are flights less expensive on weekdays?"),
    ("What's the best way to learn Python?", "How do I learn Python?"),
]

DIFFERENT_ANSWER = [
    ("number", "What is 15% of 200?", "What is 25% of 200?"),
    ("number", "What is 10 minus 3?", "What is 3 minus 10?"),
    ("number", "What is 12 times 8?", "What is 12 plus 8?"),
    ("number", "How many days are in three weeks?", "How many days are in four weeks?"),
    ("negation", "Which foods contain gluten?", "Which foods don't contain gluten?"),
    ("negation", "Can I take ibuprofen with food?", "Can I take ibuprofen without food?"),
    ("negation", "Is it legal to drive with headphones?", "Is it illegal to drive with headphones?"),
    ("negation", "Should I include the header row?", "Should I exclude the header row?"),
    ("negation", "How do I show hidden files?", "How do I hide files?"),
    ("name", "What is the capital of Australia?", "What is the capital of Austria?"),
    ("name", "How do I read a JSON file in Python?", "How do I read a JSON file in Java?"),
    ("name", "Does the iPhone 15 have USB-C?", "Does the Pixel 8 have USB-C?"),
    ("unit", "How many grams are in a pound?", "How many grams are in an ounce?"),
    ("unit", "How many watts does a microwave use?", "How many amps does a microwave use?"),
    ("unit", "How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
    ("unit", "Remind me in 10 minutes", "Remind me in 10 hours"),
    ("date", "Is the store open on Sunday?", "Is the store open on Monday?"),
    ("date", "What's the forecast for tomorrow?", "What's the forecast for today?"),
    ("date", "What holidays are there in May?", "What holidays are there in June?"),
    ("date", "Set an alarm for 7 am", "Set an alarm for 7 pm"),
    ("comparison", "What is the largest ocean?", "What is the smallest ocean?"),
    ("comparison", "What is the tallest building?", "What is the oldest building?"),
    ("comparison", "Should I stretch before running?", "Should I stretch after running?"),
    ("comparison", "What's the fastest way to thaw chicken?", "What's the safest way to thaw chicken?"),
    ("unrelated_same_topic", "How do I convert a list to a string?", "How do I convert a string to a list?"),
]


@pytest.mark.parametrize(("a", "b"), SAME_ANSWER)
def test_the_guard_passes_questions_that_share_their_answer(a: str, b: str) -> None:
    assert answer_tokens_match(a, b)
    assert answer_tokens_match(b, a)


@pytest.mark.parametrize(("category", "a", "b"), DIFFERENT_ANSWER)
def test_the_guard_stops_near_misses(category: str, a: str, b: str) -> None:
    assert not answer_tokens_match(a, b), category
    assert not answer_tokens_match(b, a), category


def test_answer_tokens_normalise_numbers_units_and_names() -> None:
    tokens = answer_tokens("Can a 16 year old drive 2,000 miles in Canada's north by March 3rd?")
    assert tokens.quantities == ("16 year", "2000 mi", "3")
    assert "canada" in tokens.names
    assert tokens.dates == frozenset({"march"})


# ------------------------------------------------------------------------------- the labelled set

def labelled_pairs() -> list[dict]:
    text = (resources.files("tidegate") / "data" / "semantic_pairs.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_the_labelled_set_is_large_enough_and_well_formed() -> None:
    pairs = labelled_pairs()
    categories = Counter(p["category"] for p in pairs)
    near_miss_categories = {"number", "negation", "name", "unit", "date", "comparison", "unrelated_same_topic"}
    assert set(categories) == near_miss_categories | {"paraphrase"}
    assert all(p["same_answer"] == (p["category"] == "paraphrase") for p in pairs)
    assert all(p["a"].strip() and p["b"].strip() and p["a"] != p["b"] for p in pairs)
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)
    assert len(pairs) >= 300 and categories["paraphrase"] >= 120
    assert sum(categories[c] for c in near_miss_categories) >= 150
    assert min(categories[c] for c in near_miss_categories) >= 20


@pytest.mark.slow
def test_the_hit_rule_meets_the_bar_on_the_labelled_set_with_minilm() -> None:
    from tidegate.engine.embeddings import EmbeddingModel

    pairs = labelled_pairs()
    model = EmbeddingModel.load("all-MiniLM-L6-v2")
    texts = sorted({t for p in pairs for t in (p["a"], p["b"])}, key=len)
    vectors = dict(zip(texts, np.concatenate([model.embed(texts[i:i + 64]) for i in range(0, len(texts), 64)])))

    def hits(pair: dict) -> bool:
        similarity = float(vectors[pair["a"]] @ vectors[pair["b"]])
        return similarity >= DEFAULT_SIMILARITY_THRESHOLD and answer_tokens_match(pair["a"], pair["b"])

    near_misses = [p for p in pairs if not p["same_answer"]]
    paraphrases = [p for p in pairs if p["same_answer"]]
    false_hit_rate = sum(map(hits, near_misses)) / len(near_misses)
    paraphrase_hit_rate = sum(map(hits, paraphrases)) / len(paraphrases)
    assert false_hit_rate <= 0.01
    # measured 0.689 (bench/semantic_cache.py, bf16 and fp32 alike); the margin absorbs precision
    # differences between CPUs, not a weaker rule
    assert paraphrase_hit_rate >= 0.64
