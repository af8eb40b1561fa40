"""Unified FP8 precision: one recipe (``recipe.py``), block quantizers (``quant.py``), block GEMM
backends (``gemm.py``), the FP8 linear and its weight cache (``linear.py``), HF block-FP8 format
(``hf_format.py``)."""
from megatron_jetrl.precision.recipe import FP8Recipe

__all__ = ["FP8Recipe"]
