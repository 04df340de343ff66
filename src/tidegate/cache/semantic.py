"""The semantic response cache's pure core: an index of embedded questions and the guard that keeps
look-alike questions with different answers apart. The gateway drives it (embeds, builds scopes,
stores answers, persists entries); this module does no I/O and reads no clock.

A request is answered from the semantic cache when its last user turn is a paraphrase of a cached
request's last user turn *in the same scope*. The scope is the caller's hash of everything else that
sets the answer: tenant, model, system prompt, sampling parameters and the earlier turns. Within a
scope, a candidate must pass two tests:

1. cosine similarity of the two MiniLM embeddings >= the threshold, and
2. the guard, `answer_tokens_match`: the tokens that decide an answer (numbers, negations, names,
   units, dates, comparison words, opposites, conversion direction) agree.

Why a guard: embeddings see "What is 15% of 200?" and "What is 25% of 200?" as the same question
(cosine 0.97), and so for most near-misses that differ in one number, negation, unit or date. On
the 592 hand-labelled pairs of src/tidegate/data/semantic_pairs.jsonl (bench/semantic_cache.py),
similarity alone gives 52 % false hits at the threshold where it finds 72 % of paraphrases (0.86),
and still 16 % at 0.96, where it finds 11 %: no threshold reaches the bar (false hits <= 1 %) with
useful recall. With the guard, 0.86 gives 0.3 % false hits and finds 69 % of paraphrases.

Storage, chosen by measurement (bench/semantic_cache.py: 10,000 entries of 384 dimensions, 2 cores):
one contiguous float32 matrix per scope, grown by doubling, rows kept dense by swap-remove. A
lookup multiplies only its own scope's rows, with no gather and no mask. With 1,000 scopes of 10
entries a lookup takes ~5 us, against ~90 us for the other layout considered (one preallocated
matrix for every scope, every row multiplied, other scopes masked); with all 10,000 entries in one
scope both take ~86 us. A lookup that finds a candidate adds the guard (~55 us).

Not thread-safe: one event loop (or one lock) drives an index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tidegate.cache.answer_guard import AnswerTokens, answer_token_mismatches, answer_tokens, answer_tokens_match

__all__ = [
    "DEFAULT_SIMILARITY_THRESHOLD",
    "AnswerTokens",
    "SemanticEntry",
    "SemanticHit",
    "SemanticIndex",
    "answer_token_mismatches",
    "answer_tokens",
    "answer_tokens_match",
]

DEFAULT_SIMILARITY_THRESHOLD = 0.86
"""Cosine similarity (MiniLM-L6-v2, L2-normalised) a cached question must reach, the guard passed too.

Chosen by bench/semantic_cache.py on the 592 labelled pairs (228 paraphrases, 364 near-misses): the
lowest threshold of its grid (0.70, 0.72, ... 0.98) whose false-hit rate with the guard is at most
half the bar, a margin for questions unlike the labelled ones. At 0.86: 1 false hit in 364
(0.3 %: "time complexity" / "space complexity of quicksort", cosine 0.90, which no answer token
tells apart), 69 % of paraphrases hit, precision 0.994. One step lower, 0.84, lets 4 through (1.1 %);
0.92 lets none through but finds only 34 % of paraphrases.
"""


# --------------------------------------------------------------------------------------------- index

@dataclass(frozen=True, slots=True)
class SemanticHit:
    entry_key: str  # the caller's key of the cached answer
    similarity: float  # cosine similarity of the two questions, in [-1, 1]


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    """One entry, as `snapshot` gives it and `restore` takes it (e.g. a Redis hash per entry)."""

    scope: str
    entry_key: str
    text: str  # the question as embedded (the last user turn)
    vector: bytes  # `dim` little-endian float32 values, L2-normalised: np.frombuffer(vector, "<f4")


@dataclass(slots=True)
class _Entry:
    scope: str
    text: str
    tokens: AnswerTokens
    row: int  # its row in the scope's matrix; moves when another entry is swap-removed


class _Scope:
    """One scope's vectors: rows [0, size) of a matrix that doubles when full."""

    __slots__ = ("vectors", "keys", "size")
    _INITIAL_ROWS = 8

    def __init__(self, dim: int) -> None:
        self.vectors = np.empty((self._INITIAL_ROWS, dim), dtype=np.float32)
        self.keys: list[str] = []  # entry key of each row
        self.size = 0

    def append(self, vector: np.ndarray, entry_key: str) -> int:
        if self.size == len(self.vectors):
            grown = np.empty((2 * len(self.vectors), self.vectors.shape[1]), dtype=np.float32)
            grown[: self.size] = self.vectors[: self.size]
            self.vectors = grown
        self.vectors[self.size] = vector
        self.keys.append(entry_key)
        self.size += 1
        return self.size - 1

    def remove(self, row: int) -> str | None:
        """Removes `row` by moving the last row into it; returns the key of the moved entry, if any."""
        last = self.size - 1
        moved = None
        if row != last:
            self.vectors[row] = self.vectors[last]
            self.keys[row] = self.keys[last]
            moved = self.keys[row]
        self.keys.pop()
        self.size -= 1
        if len(self.vectors) > self._INITIAL_ROWS and self.size <= len(self.vectors) // 4:
            # give memory back after many removals, keeping room to grow without copying at once
            self.vectors = self.vectors[: len(self.vectors) // 2].copy()
        return moved


class SemanticIndex:
    """Embedded questions grouped by scope, bounded at `max_entries` by least-recent use.

    - `add(scope, vector, text, entry_key)` stores a question (replacing one with the same key) and
      returns the keys it evicted, whose answers the caller should drop;
    - `lookup(scope, vector, text, threshold)` is a query: the most similar entry of that scope at
      or above `threshold` that passes the guard, or None; it changes nothing;
    - `touch(entry_key)` marks an entry used (the caller calls it when it serves the hit), so
      eviction takes the least recently added or served;
    - `remove(entry_key)` forgets one (its answer expired or was deleted);
    - `snapshot()` / `restore(entries)` give and take every entry, least recent first.

    Vectors are `dim` floats; they are L2-normalised on the way in, so the dot product is the cosine.
    """

    def __init__(self, max_entries: int, dim: int) -> None:
        if max_entries < 1 or dim < 1:
            raise ValueError("max_entries and dim must be >= 1")
        self.max_entries = max_entries
        self.dim = dim
        self._scopes: dict[str, _Scope] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_key: object) -> bool:
        return entry_key in self._entries

    @property
    def scope_count(self) -> int:
        return len(self._scopes)

    def _unit_vector(self, vector: np.ndarray | list[float]) -> np.ndarray:
        array = np.asarray(vector, dtype=np.float32).reshape(-1)
        if array.shape != (self.dim,):
            raise ValueError(f"expected a vector of {self.dim} values, got {array.shape[0]}")
        norm = float(np.linalg.norm(array))
        if not np.isfinite(norm) or norm == 0.0:
            raise ValueError("vector must be finite and non-zero")
        return array / norm

    def add(self, scope: str, vector: np.ndarray | list[float], text: str, entry_key: str) -> tuple[str, ...]:
        """Stores `text` under `entry_key` in `scope`; returns the keys evicted to stay within bounds."""
        unit = self._unit_vector(vector)
        if entry_key in self._entries:
            self.remove(entry_key)
        matrix = self._scopes.get(scope)
        if matrix is None:
            matrix = self._scopes[scope] = _Scope(self.dim)
        row = matrix.append(unit, entry_key)
        self._entries[entry_key] = _Entry(scope=scope, text=text, tokens=answer_tokens(text), row=row)
        evicted = []
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self.remove(oldest)
            evicted.append(oldest)
        return tuple(evicted)

    def lookup(self, scope: str, vector: np.ndarray | list[float], text: str,
               threshold: float = DEFAULT_SIMILARITY_THRESHOLD) -> SemanticHit | None:
        """The most similar entry of `scope` with cosine >= `threshold` whose text passes the guard
        against `text`; None if there is none. Changes nothing (call `touch` to serve it)."""
        query = self._unit_vector(vector)
        matrix = self._scopes.get(scope)
        if matrix is None:
            return None
        similarities = matrix.vectors[: matrix.size] @ query
        candidates = np.flatnonzero(similarities >= threshold)
        if candidates.size == 0:
            return None
        query_tokens = answer_tokens(text)  # read only when some entry is similar enough
        for row in candidates[np.argsort(-similarities[candidates], kind="stable")]:
            entry_key = matrix.keys[row]
            if not answer_token_mismatches(query_tokens, self._entries[entry_key].tokens):
                return SemanticHit(entry_key=entry_key, similarity=float(similarities[row]))
        return None

    def touch(self, entry_key: str) -> bool:
        """Marks an entry most recently used (its answer was served); False if it is not here."""
        if entry_key not in self._entries:
            return False
        self._entries.move_to_end(entry_key)
        return True

    def remove(self, entry_key: str) -> bool:
        """Forgets an entry; False if it was not here."""
        entry = self._entries.pop(entry_key, None)
        if entry is None:
            return False
        matrix = self._scopes[entry.scope]
        moved = matrix.remove(entry.row)
        if moved is not None:
            self._entries[moved].row = entry.row
        if matrix.size == 0:
            del self._scopes[entry.scope]
        return True

    def snapshot(self) -> list[SemanticEntry]:
        """Every entry, least recently used first."""
        result = []
        for entry_key, entry in self._entries.items():
            vector = self._scopes[entry.scope].vectors[entry.row]
            result.append(SemanticEntry(scope=entry.scope, entry_key=entry_key, text=entry.text,
                                        vector=vector.astype("<f4").tobytes()))
        return result

    def restore(self, entries: Iterable[SemanticEntry]) -> tuple[str, ...]:
        """Replaces the contents with `entries` (least recently used first, as `snapshot` gives
        them); returns the keys left out to stay within `max_entries` (the least recent)."""
        # every vector is checked before anything is replaced: a bad entry leaves the index as it was
        loaded = [(entry, self._unit_vector(np.frombuffer(entry.vector, dtype="<f4"))) for entry in entries]
        self._scopes.clear()
        self._entries.clear()
        evicted: list[str] = []
        for entry, vector in loaded:
            evicted.extend(self.add(entry.scope, vector, entry.text, entry.entry_key))
        return tuple(evicted)
