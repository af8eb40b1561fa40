"""Prompt sets: JSONL / Parquet files (prompt, answer, optional metadata) and the built-in
synthetic arithmetic task of the tiny preset.

A prompt is a string or a list of chat messages (``[{"role": "user", "content": "..."}]``); keys may be
dotted paths into nested columns (``reward_model.ground_truth``, the layout of the GRPO parquet files verl
and slime use); several files are read in order.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Union


class DataError(ValueError):
    """A bad prompt file; one line naming the file/row and the fix."""


Messages = list[dict]


@dataclass
class Sample:
    prompt: Union[str, Messages]
    answer: str
    metadata: dict = field(default_factory=dict)


def _get(row: dict, dotted: str):
    """``row["a"]["b"]`` for ``"a.b"`` (a key that itself holds the dot is looked up first); KeyError if absent."""
    if dotted in row:
        return row[dotted]
    node = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _messages(value, where: str) -> Union[str, Messages]:
    """A prompt as given: a string, or chat messages with string roles and contents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"data: {where}: the prompt is a {type(value).__name__}, not a string or a list of "
                    '{"role": ..., "content": ...} messages')


def _rows(path: str) -> list:
    if not os.path.isfile(path):
        raise DataError(f"data.path: {path!r} not found; give a .jsonl or .parquet prompt file")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("Parquet prompts need pyarrow: pip install 'megatron_jetrl[data]'") from None
        return pq.read_table(path).to_pylist()
    if not path.endswith((".jsonl", ".json")):
        raise DataError(f"data.path: {path!r} has an unknown extension; use .jsonl or .parquet")
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"data.path: {path}:{n} is not UTF-8 (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"data.path: {path}:{n} is not valid JSON ({e.msg}); "
                                    "write one JSON object per line") from None
    return rows


def load_prompts(paths: Union[str, list[str]], prompt_key: str = "prompt", answer_key: str = "answer") -> list[Sample]:
    """Read ``paths`` (.jsonl or .parquet, in order); every row needs ``prompt_key`` and ``answer_key`` (dotted
    paths reach into nested columns); the other top-level columns become the sample's metadata."""
    out = []
    for path in [paths] if isinstance(paths, str) else paths:
        rows = _rows(path)
        if not rows:
            raise DataError(f"data.path: {path} holds no rows")
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise DataError(f"data.path: row {n} of {path} is a {type(row).__name__}, not an object; write rows "
                                f'like {{"{prompt_key}": "...", "{answer_key}": "..."}}')
            try:
                prompt, answer = _get(row, prompt_key), _get(row, answer_key)
            except KeyError as e:
                raise DataError(f"data.path: row {n} of {path} has no {e.args[0]!r} field; "
                                f"set data.prompt_key/data.answer_key to its column names (dotted for nested ones)") from None
            meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
            out.append(Sample(_messages(prompt, f"row {n} of {path}"), str(answer), meta))
    return out


def synthetic_arithmetic(n: int, seed: int = 0, max_operand: int = 9) -> list[Sample]:
    """``a+b=`` -> ``a+b`` for single digits: a verifiable task a tiny model learns in minutes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Sample(f"{a}+{b}=", str(a + b), {"a": a, "b": b}))
    return out


class PromptStream:
    """Endless shuffled epochs over a prompt list; its position is part of the checkpoint."""

    def __init__(self, samples: list[Sample], seed: int):
        self.samples, self.seed = samples, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self):
        order = list(range(len(self.samples)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Sample]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.samples[self._order[self.pos]])
            self.pos += 1
        return out

    def next_share(self, n: int, rank: int, world: int) -> list[Sample]:
        """Data-parallel rank ``rank``'s ``n`` samples: every rank draws the same ``n * world`` (so the stream
        position stays one number) and takes its own slice."""
        return self.next(n * world)[rank * n:(rank + 1) * n]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()
