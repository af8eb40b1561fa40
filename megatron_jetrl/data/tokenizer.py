"""Tokenizers: a small built-in character tokenizer (tiny preset) and HF tokenizers from a path.

``encode_prompt`` turns a prompt (a string or chat messages) into the ids the policy sees: through the HF
tokenizer's chat template with its generation prompt when the template applies (``data.apply_chat_template``;
a ``data.system_prompt`` goes first for string prompts), else bos + the raw text.
"""
from __future__ import annotations

import string


def _chat_refused(prompt) -> None:
    from megatron_jetrl.data.prompts import DataError

    if not isinstance(prompt, str):
        raise DataError("data: a prompt is a list of chat messages but no chat template applies; use a tokenizer "
                        "with one (model.tokenizer) and data.apply_chat_template auto or true, or string prompts")


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

    def encode_prompt(self, prompt) -> list[int]:
        _chat_refused(prompt)
        return [self.bos_id] + self.encode(prompt)

    def render(self, ids) -> str:
        """``ids`` as text with the special tokens shown."""
        return "".join(self.vocab[i] for i in ids if 0 <= i < len(self.vocab))


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded from a local directory."""

    def __init__(self, path: str, chat="auto", system_prompt: str | None = None):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("HF tokenizers need transformers: pip install 'megatron_jetrl[hf]'") from None
        self.tok = AutoTokenizer.from_pretrained(path)
        has = bool(getattr(self.tok, "chat_template", None))
        if chat is True and not has:
            from megatron_jetrl.config import ConfigError

            raise ConfigError(f"config error: data.apply_chat_template: true, but the tokenizer in {path} has no "
                              "chat template; set it to auto or false")
        self.chat = has if chat == "auto" else bool(chat)
        self.system_prompt = system_prompt
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

    def render(self, ids) -> str:
        """``ids`` as text with the special tokens shown."""
        return self.tok.decode(ids, skip_special_tokens=False)

    def encode_prompt(self, prompt) -> list[int]:
        if not self.chat:
            _chat_refused(prompt)
            ids = self.encode(prompt)
            return ([self.bos_id] + ids) if self.bos_id is not None else ids
        messages = prompt if not isinstance(prompt, str) else (
            ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            + [{"role": "user", "content": prompt}])
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)  # the template writes its own bos


def load_tokenizer(spec: str, chat="auto", system_prompt: str | None = None):
    """``builtin`` or an HF tokenizer directory; ``chat``/``system_prompt``: ``data.apply_chat_template`` and
    ``data.system_prompt``."""
    if spec == "builtin":
        if chat is True:
            from megatron_jetrl.config import ConfigError

            raise ConfigError("config error: data.apply_chat_template: true, but the built-in tokenizer has no chat "
                              "template; set model.tokenizer to an HF tokenizer directory, or auto/false")
        return CharTokenizer()
    return HFTokenizer(spec, chat, system_prompt)
