"""RoPE frequency scaling of the HF model families (``rope_scaling`` / ``rope_parameters`` in config.json):
``linear``, ``llama3`` (Llama-3.1 and later) and ``yarn`` (Qwen2.5's long-context setting), computed as
transformers computes them (tests compare with its ``ROPE_INIT_FUNCTIONS``), in fp32.

    inv_freq[i] = theta ** (-2i / d),  i < d/2                                   (default)
    linear:  inv_freq / factor
    llama3:  wavelength 2pi/inv_freq above orig/low_freq_factor -> inv_freq / factor; below
             orig/high_freq_factor -> unchanged; between -> (1 - s) inv_freq / factor + s inv_freq,
             s = (orig / wavelength - low) / (high - low)
    yarn:    inv_freq / factor on the dimensions that rotate less than beta_slow times over orig positions,
             unchanged above beta_fast rotations, a linear ramp between; cos and sin scaled by
             attention_factor (default 0.1 ln(factor) + 1), which the attention applies as a softmax scale
             of attention_factor**2 / sqrt(head_dim) (the same q.k)

``factor`` etc. are the config's keys; ``original_max_position_embeddings`` is the pretraining context.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}


def rope_problem(params: dict | None) -> str | None:
    """Why ``params`` (the config's rope parameters without ``rope_theta``) cannot be run, or None."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    missing = [k for k in REQUIRED.get(kind, ()) if params.get(k) is None]
    return f"rope_type {kind!r} needs {', '.join(missing)}" if missing else None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(head_dim: int, theta: float, params: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, attention_factor) for ``params`` (None: plain RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if kind == "default":
        return inv, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    orig = params["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        return torch.where(medium, smoothed, out), 1.0
    # yarn
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = 1 - ramp
    pos = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)
