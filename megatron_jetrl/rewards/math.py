"""Math answers: GSM8K ``#### x``, ``\\boxed{x}``, or the last number; numeric equivalence."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a response: ``\\boxed{}`` first, then GSM8K ``####``, then the last
    number in the text."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def to_number(text: str) -> Optional[Fraction]:
    s = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    m = re.fullmatch(r"\\(?:d?frac)\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(pred: Optional[str], ref: str) -> bool:
    if pred is None:
        return False
    a = to_number(pred)
    b = to_number(ref)
    if b is None and (ref_final := extract_answer(ref)) is not None:  # a worked reference solution
        b = to_number(ref_final)
    if a is not None and b is not None:
        return a == b
    return pred.strip() == ref.strip()


def math_reward(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the extracted final answer equals the reference numerically, else 0.0."""
    return 1.0 if answers_equal(extract_answer(response), answer) else 0.0


def exact_reward(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the whole response (stripped) equals the reference."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def hash_reward(response: str, answer: str, metadata: dict) -> float:
    """A pseudo-random reward in [0, 1): the response's SHA-256 read as a fraction (the same text always
    scores the same). For speed benchmarks on random weights (``jetrl bench step``): there a verifiable
    reward is 0 for every response, so GRPO's advantages, and with them every gradient of the training
    step, would be zero, and the backward's GEMMs would run on zeros (faster than on real gradients: less
    power, higher clocks). With this reward every group has a spread, as a batch that carries signal."""
    import hashlib

    digest = hashlib.sha256(response.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64
