"""Tokenizers: a small built-in character tokenizer (tiny preset) and HF tokenizers from a path."""
from __future__ import annotations

import string


class CharTokenizer:
    """Characters of the synthetic task plus <pad>, <bos>, <eos>; ids are stable across runs."""

    SPECIAL = ["<pad>", "<bos>", "<eos>"]
    CHARS = string.digits + "+-*=# ?:abcdefghijklmnopqrstuvwxyz\\{}"

    def __init__(self):
        self.vocab = self.SPECIAL + list(self.CHARS)
        self._ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"builtin tokenizer: character {e.args[0]!r} is not in its vocabulary; "
                             "use model.tokenizer=<HF tokenizer dir> for real text") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(self.SPECIAL) and i < len(self.vocab))


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded from a local directory."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("HF tokenizers need transformers: pip install 'megatron_jetrl[hf]'") from None
        self.tok = AutoTokenizer.from_pretrained(path)
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str):
    """``builtin`` or an HF tokenizer directory."""
    return CharTokenizer() if spec == "builtin" else HFTokenizer(spec)
