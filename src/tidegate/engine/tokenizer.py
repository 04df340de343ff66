"""Tokenizers behind one small surface: the shipped byte-level one and Hugging Face's AutoTokenizer.

Both render chat messages to prompt token ids and decode generated ids incrementally, so that a
stream never emits half of a multi-byte character.
"""

from __future__ import annotations

import codecs
from typing import Any, Protocol

__all__ = ["Tokenizer", "IncrementalDecoder", "ByteTokenizer", "HFTokenizer"]

# A ChatML-shaped template for models that ship none (the preset, bare checkpoints).
_FALLBACK_TEMPLATE_ROLE_START = "<|im_start|>"
_FALLBACK_TEMPLATE_ROLE_END = "<|im_end|>"


class IncrementalDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Text that became complete with this token (may be empty)."""
        ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...

    def encode_continuation(self, text: str) -> list[int]:
        """Text that continues a prompt (an open assistant turn): no BOS or other specials added."""
        ...

    def decoder(self) -> IncrementalDecoder: ...


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return ""  # special tokens are never rendered
        return self._utf8.decode(bytes((token_id,)))


class ByteTokenizer:
    """256 byte tokens plus three specials; needs no file."""

    END_OF_TEXT = 256
    IM_START = 257
    IM_END = 258
    vocab_size = 259

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.END_OF_TEXT, self.IM_END})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # specials are inserted as ids, so message text can never forge a role boundary
        ids: list[int] = []
        for message in messages:
            ids += [self.IM_START, *self.encode(f"{message['role']}\n{message['content']}"), self.IM_END]
            ids += self.encode("\n")
        return ids + [self.IM_START, *self.encode("assistant\n")] if add_generation_prompt else ids

    def encode_continuation(self, text: str) -> list[int]:
        return self.encode(text)

    def decoder(self) -> IncrementalDecoder:
        return _ByteDecoder()


class _HFDecoder:
    """Re-decodes the generated ids and emits the new suffix once it is no longer a partial character."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new


class HFTokenizer:
    def __init__(self, model_dir: str, extra_eos_ids: frozenset[int] = frozenset()) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self._tokenizer)
        eos = self._tokenizer.eos_token_id
        self.eos_token_ids = frozenset({eos} if eos is not None else set()) | extra_eos_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if getattr(self._tokenizer, "chat_template", None):
            text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False)
        else:
            text = "".join(
                f"{_FALLBACK_TEMPLATE_ROLE_START}{m['role']}\n{m['content']}{_FALLBACK_TEMPLATE_ROLE_END}\n"
                for m in messages
            ) + (f"{_FALLBACK_TEMPLATE_ROLE_START}assistant\n" if add_generation_prompt else "")
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_continuation(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decoder(self) -> IncrementalDecoder:
        return _HFDecoder(self._tokenizer)
