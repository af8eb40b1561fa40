"""Unified FP8 precision: the recipe (``recipe.py``, the numbers), the quantization rule (``quant.py``), the block
GEMM dispatch (``gemm.py``), the FP8 linear and its weight cache (``linear.py``), fused-weight row layouts
(``layout.py``) and the TransformerEngine translation (``te_backend.py``). The kernels they call are in
``megatron_jetrl/kernels``."""
from megatron_jetrl.precision.recipe import FP8Recipe

__all__ = ["FP8Recipe"]
