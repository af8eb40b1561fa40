"""Static-shape decoding over the trainer's megatron-core model, CUDA-graph captured.

megatron-core's eager decode (``StaticInferenceContext``) costs about 20x the weight-bandwidth
bound on the H200: every token walks Python through 32 layers and
launches a few hundred kernels, and the attention's key length grows by one per token, so nothing
can be captured. ``StaticDecoder`` runs the same modules (embedding, norms, ``linear_qkv``,
``linear_proj``, MLP, output layer: so the same FP8 linears on the same cached weight bytes) around
its own KV cache with static shapes:

- one KV cache for all layers, ``[layers, B, groups, L, dim]``, written in place at the step's
  position (a device tensor, no host sync); with ``precision.kv_cache=fp8`` E4M3 bytes plus one power-of-two
  scale per token and KV head (``[layers, B, groups, L]``), the recipe's KV rule, which the trainer's attention
  applies to its own K/V (``models/spec.py: SDPAttention``);
- the attention reads keys ``[:Lb]`` for a length bucket ``Lb`` (a multiple of ``bucket``, widened for
  long contexts so that there are at most ``max_graphs`` buckets: ``wide_bucket``): one CUDA graph per
  bucket, so a step reads the cache up to the next bucket edge instead of the whole ``max_len``; pad and
  not-yet-written keys are masked by a per-row validity mask;
- attention on ``scaled_dot_product_attention`` with one additive mask per step shared by all
  layers, grouped-query heads reading K/V in place; or (``attention="triton"``,
  ``rollout.decode_attention``) decode steps on ``triton_attn.decode_attention``, which reads the
  key count from the position tensor: keys ``0..pos`` only, no mask tensor, one graph for all lengths;
- RoPE from the model's own ``rotary_pos_emb`` table, indexed per row by the token's position in its own
  sequence (left pads not counted, as in the trainer's forward), its cos/sin rows computed once per forward;
  on CUDA RoPE and the KV-cache write are one Triton kernel per layer (``kernels/rope.py``: megatron's
  unfused RoPE is ~12 small kernels per tensor, same bytes);
- on CUDA the residual add and the RMSNorm are one kernel (``kernels/rmsnorm.py``; optionally with the next
  FP8 linear's activation quantization), and the FP8 fused QKV output is split in the rollout's
  [q | k | v] order.

Exact mode (``precision.exact``, ``exact=True``): every op with the bits of the trainer's forward (the fused norm
kernel's and the attention kernel's activation bytes are the trainer's quantizer's; the fused QKV split in the
rollout's order gives each column its bits in Megatron's order), prefill and decode
steps on ``kernels/exact_attn.py`` over a KV cache indexed by each row's own position (a row's token at position
``p`` in column ``p``, as in the trainer's sequences; no left pads in it); with the batch-invariant GEMMs
(``kernels/exact_gemm.py``) a row's logits are the bits of the trainer's forward.

Prefill runs the same code eagerly (in batch chunks that bound the score tensor and the activations).
Sampling stays outside the graph (on the GPU, no host sync; one Triton kernel for temperature
sampling, ``kernels/sample.py``). Graphs are captured on first use of a bucket
and reused while the weight storage is unchanged (the FP8 cache refreshes in place; see
``fingerprint``). Dense models only: MoE routing is data dependent and runs eagerly.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_jetrl.config import RolloutConfig
from megatron_jetrl.env import triton_interpreted
from megatron_jetrl.errors import ConfigError
from megatron_jetrl.kernels.rmsnorm import add_rmsnorm_quant
from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables, rope_torch
from megatron_jetrl.models.norm import JetRMSNorm
from megatron_jetrl.precision.quant import dequantize_kv, quantize_kv
from megatron_jetrl.precision.recipe import FP8Recipe, kv_cache_bytes

log = logging.getLogger(__name__)
CACHE_ALIGN = 64  # keys: the KV cache's rows (and a key-major V's feature rows) start at multiples of 64 keys


# ``rollout.fp8_kv_v_layout=auto``: V key-major from this HBM bandwidth per SM up (GB/s; H200 37, H100 SXM 25)
KEY_MAJOR_V_MIN_GBPS_PER_SM = 30.0


def hbm_gbps_per_sm(device: torch.device) -> float | None:
    """Peak memory bandwidth per SM of a CUDA ``device`` in GB/s (2 transfers per memory clock x bus width / SMs),
    None off CUDA or where the driver reports no memory clock."""
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 / p.multi_processor_count


def fp8_v_layout(choice: str, device: torch.device) -> str:
    """``rows`` or ``key_major`` for ``rollout.fp8_kv_v_layout`` (``auto``: by the device's bandwidth per SM, above)."""
    if choice not in ("auto", "rows", "key_major"):
        raise ValueError(f"rollout.fp8_kv_v_layout={choice!r}: use auto, rows or key_major")
    if choice != "auto":
        return choice
    bw = hbm_gbps_per_sm(device)
    return "key_major" if bw is not None and bw >= KEY_MAJOR_V_MIN_GBPS_PER_SM else "rows"


def cache_fit_problem(need: int, free: int, rows: int, length: int, fp8: bool) -> str | None:
    """One line naming what to change when a decoder's KV cache (``need`` bytes for ``rows`` x ``length``
    positions) exceeds the ``free`` bytes of its GPU, else None."""
    if need <= free:
        return None
    fewer = "decode fewer rows at once (rollout.decode_rows; a fleet's rollout.chunk_size) or " if rows > 1 else ""
    return (f"config error: rollout decode: a KV cache of {rows} row{'s' * (rows != 1)} x {length} positions needs "
            f"{need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB free on the GPU; {fewer}shorten rollout.max_new_tokens"
            + ("" if fp8 else ", or set precision.kv_cache=fp8 (half the bytes)"))


def aligned_len(max_len: int) -> int:
    """Positions a decoder cache row of ``max_len`` holds: ``max_len`` rounded up to ``CACHE_ALIGN``."""
    return -(-max_len // CACHE_ALIGN) * CACHE_ALIGN


def cache_bytes(model, rows: int, max_len: int, fp8: bool) -> int:
    """Bytes of the static decoder's KV cache for ``rows`` x ``max_len`` positions of ``model``: K and V of every
    layer (``recipe.kv_cache_bytes``: the FP8 cache's E4M3 bytes and fp32 scales) and a validity byte per
    position, each row ``CACHE_ALIGN``-aligned."""
    gpt = unwrap(model)
    layers = list(gpt.decoder.layers)
    attn = layers[0].self_attention
    La = aligned_len(max_len)
    return kv_cache_bytes(rows * La, layers=len(layers), kv_heads=attn.num_query_groups_per_partition,
                          head_dim=attn.hidden_size_per_attention_head, fp8=fp8,
                          elem_bytes=next(gpt.parameters()).dtype.itemsize) + rows * La


# a prefill chunk's bounds (``StaticDecoder.prefill_rows``): its fp32 attention scores, its tokens (the MLP's activations)
PREFILL_SCORE_BYTES = 2 << 30
PREFILL_TOKENS = 16384


def work_bytes(model) -> int:
    """Bytes the static decoder's own work may take beside its KV cache, a bound: a prefill chunk's fp32 attention
    scores (``PREFILL_SCORE_BYTES``) and, for its ``PREFILL_TOKENS`` tokens in fp32, the MLP's gate/up and SwiGLU
    outputs (3 x ffn, times the experts a token is routed to) and four hidden-wide tensors (residual, norm,
    attention in and out): an 8B model 2.1 + 3.9 GB. What the engine keeps free when it sizes its waves (a decode
    step's logits and sampling, a few vocabulary-wide rows each, are ~1/300 of a row's 8K-token FP8 cache; the
    decoder's own check against the free memory counts the cache alone)."""
    c = unwrap(model).config
    ffn = c.ffn_hidden_size * (c.moe_router_topk if getattr(c, "num_moe_experts", None) else 1)
    return PREFILL_SCORE_BYTES + PREFILL_TOKENS * 4 * (3 * ffn + 4 * c.hidden_size)


def free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on CUDA ``device`` can take: the driver's free memory and what torch's allocator holds
    unused."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def unwrap(model):
    """The GPTModel inside DDP/Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def exact_refusal(model) -> str | None:
    """Why the static decoder cannot run exact mode (``precision.exact``) for ``model`` on the GPU, as one line
    (field: problem; fix), or None: a MoE router's GEMM is not batch-invariant there (the CPU emulation decodes MoE
    models exactly)."""
    if any(getattr(layer.mlp, "router", None) is not None for layer in unwrap(model).decoder.layers):
        return ("precision.exact: the MoE router's GEMM is not batch-invariant on the GPU; "
                "set precision.exact=false for MoE models")
    return None


def fingerprint(model) -> tuple:
    """Data pointers of every parameter and cached FP8 weight: a captured graph is valid while
    this is unchanged (it replays reads of these addresses). A released BF16 weight (jet training's
    ``Actor.release_weights``: nothing reads it, the FP8 cache stands in) is left out: its placeholder
    moves every step."""
    from megatron_jetrl.memory import is_released

    ptrs = []
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if not is_released(p):
                ptrs.append(p.data_ptr())
        cache = getattr(m, "fp8_cache", None)
        if cache is not None and cache.qweight is not None:
            ptrs += [cache.qweight.data_ptr(), cache.scale_inv.data_ptr()]
    return tuple(ptrs)


def wide_bucket(bucket: int, max_len: int, max_graphs: int) -> int:
    """The length bucket a decoder of ``max_len`` positions uses: ``bucket``, or for long contexts the smallest
    multiple of it that keeps the buckets (and so the CUDA graphs to capture, ~0.15-0.3 s each for an 8B
    model on the H200) at ``max_graphs`` or fewer (``max_graphs`` <= 0: no limit). A step then reads less
    than one bucket past its position, about 1/``max_graphs`` of the cache or less: at 32K positions with
    64-key buckets and 32 graphs, 1024-key buckets."""
    n = -(-max_len // bucket)
    if max_graphs <= 0 or n <= max_graphs:
        return bucket
    return bucket * -(-n // max_graphs)


class StaticDecoder:
    """Prefill + graph-captured decode steps for a batch of ``batch`` rows up to ``max_len`` tokens."""

    def __init__(self, model, batch: int, max_len: int, vocab_size: int | None = None,
                 bucket: int = RolloutConfig.decode_bucket,
                 use_graphs: bool | None = None, prefill_score_bytes: int = PREFILL_SCORE_BYTES,
                 prefill_tokens: int = PREFILL_TOKENS, attention: str = "sdpa", attn_splits: int | None = None,
                 max_graphs: int = RolloutConfig.decode_max_graphs, kv_recipe: FP8Recipe | None = None,
                 exact: bool = False, v_layout: str = RolloutConfig.fp8_kv_v_layout):
        self.gpt = unwrap(model)
        self.layers = list(self.gpt.decoder.layers)
        attn = self.layers[0].self_attention
        self.cfg = self.gpt.config
        self.heads, self.groups = attn.num_attention_heads_per_partition, attn.num_query_groups_per_partition
        self.dim = attn.hidden_size_per_attention_head
        self.scale = getattr(attn.core_attention, "softmax_scale", None) or self.dim ** -0.5
        self.B, self.L, self.vocab_size = batch, max_len, vocab_size
        self.bucket = wide_bucket(bucket, max_len, max_graphs)
        p = next(self.gpt.parameters())
        self.device, self.dtype = p.device, p.dtype
        moe = any(getattr(layer.mlp, "router", None) is not None for layer in self.layers)
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and moe:
            log.info("rollout decode: MoE routing is data dependent, decoding eagerly (no CUDA graphs)")
        self.use_graphs = bool(use_graphs) and self.device.type == "cuda" and not moe
        # RoPE + KV-cache write in one kernel per layer (CUDA; megatron's interleaved RoPE variant
        # keeps megatron's own function)
        self.fused_rope = self.device.type == "cuda" and not self.cfg.rotary_interleaved
        # residual add + RMSNorm (+ the next FP8 linear's activation quantization) in one kernel
        # (CUDA, the one-kernel RMSNorm of kernels/rmsnorm.py)
        self.fuse_add_norm = self.device.type == "cuda"
        # exact mode (precision.exact): every op as the trainer's forward computes it (the modules' own calls; the
        # fused add + RMSNorm + quantizer above gives the bytes of the separate ops), the GEMMs and the attention on
        # the batch-invariant kernels (kernels/exact_gemm.py, kernels/exact_attn.py; CUDA, or Triton's CPU
        # interpreter): a row's logits are the trainer's bits
        self.exact = exact
        why = exact_refusal(model) if exact else None
        if why:
            raise ConfigError(f"config error: {why}")
        if exact and not (self.device.type == "cuda" or triton_interpreted()):
            raise ValueError("StaticDecoder: exact mode runs on CUDA (or under Triton's interpreter)")
        # ... and the next FP8 linear's activation quantization in that kernel too (64 quantizer launches
        # fewer per 32-layer step; same bytes; docs/benchmarks.md, "In-process rollout"), for the small-M GEMM and for
        # the linears above small_m_max rows (cuBLAS's GEMM: batch 256, the prefill; scales column-major as
        # scaled_mm reads them): the linear then runs the GEMM alone. The tests turn these attributes off on
        # a decoder to compare with the unfused path.
        self.fuse_norm_quant = True
        self.norm_quant_cublas = True
        # ... and, on decode steps with the Triton attention (one key split) or exact mode's key-major kernel over
        # the FP8 cache, the output projection's activation quantization in the attention kernel (32 quantizer
        # launches fewer per step; same bytes)
        self.fuse_attn_quant = True
        # ... and, for the FP8 small-M GEMMs whose output only feeds that kernel (attention's output
        # projection, fc2) at TP=1, the split-K partials summed in it instead of a separate sum kernel
        # (same bytes)
        self.defer_split_sum = self.fuse_add_norm and self.cfg.tensor_model_parallel_size == 1
        # decode steps' attention: SDPA over the bucket with a mask, or the exact-length Triton kernel
        # (CUDA, or Triton's CPU interpreter for the tests); prefill always runs SDPA
        if attention not in ("sdpa", "triton"):
            raise ValueError(f"StaticDecoder: attention={attention!r}; use 'sdpa' or 'triton'")
        # the FP8 KV cache (``kv_recipe``: a recipe with kv_cache=fp8): E4M3 K/V and a power-of-two scale per token
        # and KV head; decode steps read it with the Triton kernel (SDPA reads no FP8), prefill and the CPU's SDPA
        # over its dequantized values
        self.kv_recipe = kv_recipe if kv_recipe is not None and kv_recipe.kv_cache == "fp8" else None
        if self.kv_recipe is not None and attention == "sdpa" and self.device.type == "cuda":
            log.info("rollout decode: the FP8 KV cache is read by the Triton decode attention")
            attention = "triton"
        self.triton_attn = (exact or attention == "triton") and (self.device.type == "cuda" or triton_interpreted())
        if attention == "triton" and not self.triton_attn:
            log.info("rollout decode: the Triton decode attention needs CUDA; using SDPA")
        if self.triton_attn and not exact:
            from megatron_jetrl.kernels.decode_attn import default_splits

            self.attn_splits = attn_splits or default_splits(batch, self.groups, max_len, self.device)
            # (keys per tile, pipeline stages, warps); the FP8 cache (the key-major kernel): twice the keys per tile,
            # two stages, 127 registers (4 programs per SM; tools/kernel_sass.py). Its key splits are the BF16
            # kernel's (one where rows x groups fill the GPU): one split ran 2-8% faster than two at 64 and 256
            # rows x 1K-8K keys on the H100 (docs/decode_attention.md)
            self.attn_plan = (64, 2, 4)
            if self.kv_recipe is not None:
                self.attn_plan = (128, 2, 4)
        nl, dev = len(self.layers), self.device
        kv_dtype = self.dtype if self.kv_recipe is None else self.kv_recipe.dtype
        # the cache's rows are CACHE_ALIGN keys apart (views of max_len keys): a key-major V's feature row, a row of
        # scales or of key_ok of an unaligned length is only 1-8-byte aligned and the attention's tile loads narrow
        # (H100, a key-major V of 64 x 2,280 keys: docs/decode_attention.md)
        La = self.rows_len = aligned_len(max_len)
        self.cache_bytes = cache_bytes(model, batch, max_len, self.kv_recipe is not None)
        if dev.type == "cuda":  # the cache alone must fit: one line naming the knobs, not an allocator traceback
            why = cache_fit_problem(self.cache_bytes, free_bytes(dev), batch, max_len, self.kv_recipe is not None)
            if why:
                raise ConfigError(why)

        def aligned(lead: tuple, trail: tuple, dtype: torch.dtype) -> torch.Tensor:
            """Zeros ``[*lead, La, *trail]``, viewed as ``[*lead, max_len, *trail]``."""
            t = torch.zeros(*lead, La, *trail, dtype=dtype, device=dev)
            return t[(slice(None),) * len(lead) + (slice(0, max_len),)]

        self.k = aligned((nl, batch, self.groups), (self.dim,), kv_dtype)
        # V is stored [L, d] (a step writes each KV head's value as one contiguous row) or key-major ([d, L] memory, a
        # [L, d] view: the attention's P.V tiles contiguous along the keys, a step's write one byte per feature row):
        # rollout.fp8_kv_v_layout, by default by the GPU's bandwidth per SM (the 4K x 64 rollout: H100 7.93 ms per step
        # with [L, d] vs 8.21 key-major; H200 6.42 vs 6.30, 8K 8.86 vs 8.39; docs/decode_attention.md).
        # Exact mode's FP8 cache is key-major: its attention (kernels/exact_attn.py, the trainer's too) reads it so
        self.v_key_major = self.kv_recipe is not None and (self.exact or fp8_v_layout(v_layout, dev) == "key_major")
        if self.kv_recipe is not None and not self.exact:
            log.info("rollout decode: the FP8 KV cache stores V %s", "key-major" if self.v_key_major else "[L, d]")
        if self.v_key_major:
            self.v = aligned((nl, batch, self.groups, self.dim), (), kv_dtype).transpose(3, 4)
        else:
            self.v = aligned((nl, batch, self.groups), (self.dim,), kv_dtype)
        # the FP8 cache's scales, one per token and KV head ([layers, B, groups, L] fp32); None with a BF16 cache
        self.ks = self.vs = None
        if self.kv_recipe is not None:
            self.ks = aligned((nl, batch, self.groups), (), torch.float32)
            self.vs = aligned((nl, batch, self.groups), (), torch.float32)
        self.key_ok = aligned((batch,), (), torch.bool)
        self.pads = torch.zeros(batch, dtype=torch.long, device=dev)  # each row's left pads (its RoPE offset)
        with torch.no_grad():
            self.freqs = self.gpt.rotary_pos_emb(max_len)  # [L, 1, 1, rot_dim]
        # the decode step's static inputs (its outputs are the captured graphs' own buffers)
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.fp = None
        self.capture_s = 0.0
        # the FP8 GEMM kernel per linear shape at this batch (precision.decode_gemm=tune; _tune_gemms)
        self.gemm_tuning: dict[str, dict] = {}
        self._gemm_tuned = False
        self._host_pos = 0  # the host's copy of ``pos`` (picks the bucket without a sync)
        self._written = 0  # one past the last cache column written (a prompt or a decode step) since V was zeroed
        self.prefill_score_bytes, self.prefill_tokens = prefill_score_bytes, prefill_tokens

    def prefill_rows(self, P: int) -> int:
        """Rows per prefill chunk for prompts of ``P`` tokens: the fp32 attention scores of a chunk
        ([rows, heads, P, P]) within ``prefill_score_bytes`` and its tokens within ``prefill_tokens``
        (bounds the MLP activations). Few large chunks matter for speed: each chunk runs every linear
        once, and an eager FP8 linear costs ~0.2 ms of host time (jet's prefill of 64 x 128 tokens
        was host-bound in 6 chunks of 12 rows, sized by max_len^2: docs/benchmarks.md)."""
        by_scores = self.prefill_score_bytes // max(1, 4 * self.heads * P * P)
        return max(1, min(by_scores, self.prefill_tokens // max(1, P)))

    # ---- model pieces -------------------------------------------------------------------------
    def _mask_bias(self, rows: slice, idx: torch.Tensor, Lb: int, causal: bool) -> torch.Tensor:
        """Additive attention bias [b, 1, S, Lb] (0 = attend, -inf = masked), built once per forward
        and shared by every layer: valid keys only; in prefill also causal, and a pad query sees
        itself (no all-masked row)."""
        allowed = self.key_ok[rows, None, None, :Lb]
        if causal:
            q_pos = idx[:, None]
            k_pos = torch.arange(Lb, device=idx.device)[None, :]
            allowed = (allowed & (k_pos <= q_pos)) | (k_pos == q_pos)
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))

    def _deferred(self, lin, fn, *args):
        """``fn(*args)`` (a block returning ``(out, bias)``) -> (delta, splits): the block's output plus its
        bias; with ``defer_split_sum`` and ``lin`` an FP8 linear that takes the small-M path, a split-K
        output is its unsummed fp32 partials (``splits`` > 1; see ``CallHints.defer_split_sum``,
        which defers only for a linear without bias), summed by the next ``_add_norm``."""
        defer = self.defer_split_sum and lin is not None and getattr(lin, "fp8_state", None) is not None
        if not defer:
            out, bias = fn(*args)
            return (out if bias is None else out + bias), 1
        lin.deferred_splits = 1
        with lin.hinted(defer_split_sum=True):
            out, bias = fn(*args)
        return (out if bias is None else out + bias), lin.deferred_splits

    @staticmethod
    def _summed(delta, splits: int, like: torch.Tensor) -> torch.Tensor:
        """A deferred split-K output summed (the GEMM's own sum kernel), shaped like ``like``."""
        if splits <= 1:
            return delta
        from megatron_jetrl.kernels.triton_gemm import sum_partials

        return sum_partials(delta, torch.empty(like.shape, dtype=like.dtype, device=like.device))

    def _add_norm(self, h, delta, norm, consumer, splits: int = 1):
        """``h + delta`` (when given) and ``norm`` of it -> (h, x, xq). On CUDA with the one-kernel RMSNorm
        (``kernels/rmsnorm.py``) the add and the norm are one kernel, and with ``fuse_norm_quant``, when
        ``consumer`` is an FP8 linear about to run the small-M GEMM on x, x's 1x128 quantization too
        (``xq``: the bytes and scales the linear's own quantizer would compute); otherwise torch's add
        and the norm module."""
        if not (self.fuse_add_norm and isinstance(norm, JetRMSNorm) and norm.weight is not None):
            if delta is not None:
                h = h + self._summed(delta, splits, h)
            return h, norm(h), None
        recipe, col_major = self._input_quant(consumer, h.numel() // h.shape[-1], h.shape[-1])
        return add_rmsnorm_quant(h, delta, norm.weight, norm.eps_for(h.dtype), recipe, splits, scale_col_major=col_major)

    def _input_quant(self, consumer, M: int, K: int):
        """(recipe, scales column-major) for the op producing ``consumer``'s ``[M, K]`` input to quantize it as the
        FP8 linear would (``fuse_norm_quant``), or (None, False): the small-M GEMM reads row-major scales,
        cuBLAS's scaled_mm and DeepGEMM (more rows, ``norm_quant_cublas``, unless the tuning gave the shape to the
        small-M GEMM: ``FP8ModelState.small_m``) column-major ones."""
        state = getattr(consumer, "fp8_state", None)
        if (self.fuse_norm_quant and state is not None and consumer.fp8_active()
                and consumer.fp8_backend == "scaled_mm" and K % state.recipe.group_size == 0):
            if state.small_m(M, *consumer.fp8_weight()[0].shape):
                return state.recipe, False
            if self.norm_quant_cublas:
                return state.recipe, True
        return None, False

    def _qkv(self, attn, x, xq=None):
        """(q [S, b, heads, d], k, v [S, b, groups, d], partials): megatron's ``get_query_key_value_tensors``, except
        for an FP8 fused QKV, whose cached weight rows are in the rollout's ``[q | k | v]`` order: its
        GEMM output is split in that order directly (same values, without permuting the output back to
        megatron's interleaved order and copying q out of it). ``partials``: None, or ``(splits, stride)`` where
        the small-M GEMM split K and the RoPE + cache kernel sums its fp32 partials (q, k, v views of the first;
        ``defer_split_sum`` with the fused RoPE, no q/k norms). Exact mode too: its GEMM over the rollout-ordered
        weight gives each column the bits it has in Megatron's order (the rows are whole 128 x 128 blocks moved,
        and an output element's products and their order do not depend on its column), and the RoPE + cache kernel
        sums the exact GEMM's K-segment partials in segment order, as its sum kernel does."""
        lin = attn.linear_qkv
        cache = getattr(lin, "fp8_cache", None)
        hinted = lin.hinted if hasattr(lin, "hinted") else None
        if (cache is None or cache.perm is None or not lin.fp8_active()
                or attn.config.num_query_groups < attn.world_size):
            if hinted is None or xq is None:
                return *attn.get_query_key_value_tensors(x, None), None
            with hinted(prequantized_input=xq):  # x's FP8 bytes from the fused norm (kernels/rmsnorm.py)
                return *attn.get_query_key_value_tensors(x, None), None
        defer = (self.defer_split_sum and self.fused_rope and attn.q_layernorm is None and attn.k_layernorm is None
                 and getattr(lin, "bias", None) is None)
        lin.deferred_splits = 1
        with hinted(prequantized_input=xq, rollout_layout_output=True, defer_split_sum=defer):
            out, _ = lin(x)
        splits = lin.deferred_splits if defer else 1
        part = (splits, out.stride(0)) if splits > 1 else None
        if part is not None:  # [splits, S * b, N] fp32: q, k, v from the first split (the RoPE kernel sums them)
            out = out[0].view(*x.shape[:2], out.shape[-1])
        (S, b), hd, gd = out.shape[:2], self.heads * self.dim, self.groups * self.dim
        q = out[..., :hd].view(S, b, self.heads, self.dim)
        k = out[..., hd:hd + gd].view(S, b, self.groups, self.dim)
        v = out[..., hd + gd:].view(S, b, self.groups, self.dim)
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        return q, k, v, part

    def _attention(self, li: int, q, k, v, rows: slice, idx: torch.Tensor, rope: tuple, Lb: int,
                   mask: torch.Tensor, q0: torch.Tensor | None = None, proj=None, part=None):
        """q [S, b, heads, d], k/v [S, b, groups, d] at cache columns ``idx`` [S] (``rope``: the RoPE
        table rows and their cos/sin) -> ([S, b, heads*d], xq). Exact mode: the cache is indexed by each row's own
        position (column ``idx - pads``; ``q0`` [b]: the position of column ``idx[0]``). ``xq``: on a decode step
        with the Triton kernel, the output's FP8 bytes and scales for the output projection ``proj`` (its
        activation quantization, written by the attention kernel: ``_input_quant``), else None. ``part``: q, k, v
        are views of the QKV GEMM's first fp32 partial (``_qkv``), summed by the RoPE + cache kernel."""
        S, b = idx.shape[0], q.shape[1]
        f, cos, sin = rope
        kc, vc = self.k[li, rows], self.v[li, rows]  # [b, g, L, d] views
        ks, vs = (None, None) if self.ks is None else (self.ks[li, rows], self.vs[li, rows])  # [b, g, L]
        shift = self.pads[rows] if self.exact else None
        if self.fused_rope:  # RoPE on q in place, RoPE'd k and v into the cache (quantized: FP8 KV): one kernel
            q = rope_and_cache(q, k, v, cos, sin, kc, vc, idx, ks, vs, self.kv_recipe, shift, part, self.dtype)
        else:
            if self.cfg.rotary_interleaved:
                q, k = apply_rotary_pos_emb(q, f, config=self.cfg), apply_rotary_pos_emb(k, f, config=self.cfg)
            else:
                q, k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
            self._write_kv(kc, vc, ks, vs, k, v, idx, shift)
        # the output projection's activation quantization in the Triton attention kernels (the exact key-major one
        # on a decode step over the FP8 cache; the default one with one key split): xq None where a kernel cannot
        recipe, col_major = (self._input_quant(proj, b, self.heads * self.dim)
                             if self.fuse_attn_quant and (self.exact or mask is None) else (None, False))
        if self.exact:  # prefill and decode steps: the trainer's attention kernel over the position-indexed cache
            from megatron_jetrl.kernels.exact_attn import exact_attention

            res = exact_attention(q, kc, vc, self.scale, q0, ks, vs, quant=recipe, scale_col_major=col_major)
            return res if recipe is not None else (res, None)
        if mask is None:  # a decode step on the exact-length kernel (keys 0..idx[0] where key_ok)
            from megatron_jetrl.kernels.decode_attn import decode_attention

            # the views widened to the keys their rows hold (a multiple of 16: the kernel's last tile loads whole
            # 16-key vectors; past the position they hold zeros, ``prefill``)
            kc, vc, ok = self._full_rows(kc, 2), self._full_rows(vc, 2), self._full_rows(self.key_ok[rows], 1)
            if ks is not None:
                ks, vs = self._full_rows(ks, 2), self._full_rows(vs, 2)
            # a row's valid keys run from the end of its left pads (``prefill`` checks that the pads lead) to the position
            res = decode_attention(q[0], kc, vc, ok, idx, self.scale, self.attn_splits,
                                   *self.attn_plan, k_scale=ks, v_scale=vs, quant=recipe, scale_col_major=col_major,
                                   first_key=self.pads[rows])
            out, xq = res if recipe is not None else (res, None)
            return out.view(1, b, self.heads * self.dim), xq
        kb, vb = kc[:, :, :Lb], vc[:, :, :Lb]
        if ks is not None:  # SDPA over the FP8 cache's values (exact in the model's dtype)
            kb, vb = dequantize_kv(kb, ks[:, :, :Lb], self.dtype), dequantize_kv(vb, vs[:, :, :Lb], self.dtype)
            vb = vb.contiguous()  # a key-major V's values: SDPA's fused kernels read d contiguous
        # SDPA's grouped-query path maps query head h to key/value group h // (heads/groups), the
        # grouping of Megatron's fused QKV; K/V are read in place (measured on the H200 at batch 64,
        # 768 keys: 52 us per layer vs 91 us for matmul + fp32 softmax, 1060 us with K/V expanded)
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kb, vb, attn_mask=mask,
                                             scale=self.scale, enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(S, out.shape[0], self.heads * self.dim), None

    def _write_kv(self, kc, vc, ks, vs, k, v, idx, shift=None) -> None:
        """The RoPE'd ``k`` and ``v`` [S, b, g, d] into the cache views at columns ``idx`` (torch ops: the CPU and
        megatron's interleaved RoPE), or with ``shift`` [b] at each row's own positions ``idx - shift`` (exact
        mode's position-indexed cache; left pads not written); an FP8 cache gets ``quant.quantize_kv``'s bytes and
        scales."""
        writes = []  # (cache, its scales or None, values [b, g, S, d], their scales [b, g, S] or None)
        for cache, scales, t in ((kc, ks, k), (vc, vs, v)):
            t = t.permute(1, 2, 0, 3)
            if scales is None:
                writes.append((cache, None, t.to(cache.dtype), None))
            else:  # FP8 as bytes: every device has a uint8 copy
                q8, s8 = quantize_kv(t, self.kv_recipe)
                writes.append((cache.view(torch.uint8), scales, q8.view(torch.uint8), s8))
        if shift is None:
            for cache, scales, t, s8 in writes:
                cache.index_copy_(2, idx, t)
                if scales is not None:
                    scales.index_copy_(2, idx, s8)
            return
        col = idx[None, :] - shift[:, None]  # [b, S]
        if idx.shape[0] == 1:  # a decode step: every row's position is >= 0 (no host sync inside a CUDA graph)
            r = torch.arange(col.shape[0], device=col.device)
            j = torch.zeros_like(r)
        else:  # prefill (eager): left pads have negative positions
            r, j = (col >= 0).nonzero(as_tuple=True)
        for cache, scales, t, s8 in writes:
            cache[r, :, col[r, j]] = t[r, :, j]  # [n, g, d]
            if scales is not None:
                scales[r, :, col[r, j]] = s8[r, :, j]

    def _forward(self, ids: torch.Tensor, rows: slice, pos: torch.Tensor, Lb: int, causal: bool) -> torch.Tensor:
        """ids [b, S] at positions pos.. -> logits [b, vocab] of the last position. The positions,
        their RoPE rows and the attention mask are computed once here and shared by every layer."""
        b, S = ids.shape
        idx = pos + torch.arange(S, device=ids.device)  # cache columns
        # each row's RoPE positions count from its first token (left pads excluded), as the trainer's forward and
        # a server's request number them: the same rotations, so the same K bytes (an FP8 KV cache would round a
        # shifted rotation differently); a pad column gets position 0 (masked)
        rp = (idx[:, None] - self.pads[None, rows]).clamp_min_(0)  # [S, b]
        f = self.freqs.index_select(0, rp.reshape(-1)).view(S, b, *self.freqs.shape[2:])
        rope = (f, *rope_tables(f, self.dtype))
        h = self.gpt.embedding(input_ids=ids, position_ids=idx.expand(b, S))  # [S, b, H]
        mask = None if self.exact or (self.triton_attn and not causal) else self._mask_bias(rows, idx, Lb, causal)
        q0 = idx[:1] - self.pads[rows] if self.exact else None  # each row's position at column idx[0]
        delta, splits = None, 1  # the last block's output (or its split-K partials), added by the next norm
        for li, layer in enumerate(self.layers):
            attn = layer.self_attention
            h, x, xq = self._add_norm(h, delta, layer.input_layernorm, attn.linear_qkv, splits)
            q, k, v, part = self._qkv(attn, x, xq)
            ctx, xq = self._attention(li, q, k, v, rows, idx, rope, Lb, mask, q0, attn.linear_proj, part)
            if xq is None:
                delta, splits = self._deferred(attn.linear_proj, attn.linear_proj, ctx)
            else:  # ctx's FP8 bytes from the attention kernel
                with attn.linear_proj.hinted(prequantized_input=xq):
                    delta, splits = self._deferred(attn.linear_proj, attn.linear_proj, ctx)
            fc1 = getattr(layer.mlp, "linear_fc1", None)
            h, x, xq = self._add_norm(h, delta, layer.pre_mlp_layernorm, fc1, splits)
            if xq is None:
                delta, splits = self._deferred(getattr(layer.mlp, "linear_fc2", None), layer.mlp, x)
            else:
                with fc1.hinted(prequantized_input=xq):  # x's FP8 bytes from the fused norm
                    delta, splits = self._deferred(layer.mlp.linear_fc2, layer.mlp, x)
        h = h + self._summed(delta, splits, h)
        h = self.gpt.decoder.final_layernorm(h[-1:])
        weight = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(h, weight=weight)
        logits = gather_from_tensor_model_parallel_region(logits)[0]
        return logits[:, : self.vocab_size] if self.vocab_size else logits

    # ---- public -------------------------------------------------------------------------------
    def bucket_len(self, n: int) -> int:
        """Keys a decode step at length ``n`` reads (and its graph's key): the next bucket edge for SDPA;
        the whole cache for the Triton kernel, which stops at the step's position by itself (one graph)."""
        if self.triton_attn:
            return self.L
        return min(self.L, -(-n // self.bucket) * self.bucket)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts ``tokens [B, P]`` (``key_pad`` True at pads) -> last-position logits."""
        B, P = tokens.shape
        if B != self.B or P >= self.L:
            raise ValueError(f"StaticDecoder: got {B} rows of {P} tokens for a batch of {self.B} up to {self.L}")
        fp = fingerprint(self.gpt) if self.use_graphs else None
        if fp != self.fp:  # the weights' storage moved since capture: capture again
            self.graphs.clear()
            self.graph_outputs.clear()
            self.fp = fp
        pads = key_pad.sum(1)  # the attention and exact mode's positions count a row's pads as a prefix
        if not torch.equal(key_pad, torch.arange(P, device=key_pad.device)[None, :] < pads[:, None]):
            raise ValueError("StaticDecoder.prefill: key_pad must mark left padding (each row's pads before its tokens)")
        self.key_ok.zero_()
        self.key_ok[:, :P] = ~key_pad
        if self.ks is not None and self.triton_attn and not self.exact and self._written > P:
            # the decode attention's last tile reads up to 15 keys past the step's position (weighed 0): their V
            # must be finite whatever an earlier rollout left there, so the columns decode steps wrote go back to
            # zero (the rest never left it). At most one pass over the V cache (8B, 64 rows x 8K keys: 17 GB,
            # ~5 ms at 3.5 TB/s, against ~65 s of rollout)
            self.v[:, :, :, P:self._written].zero_()
        self._written = P
        self.pads.copy_(pads)  # left padding: the pads precede the prompt
        self.pos.fill_(0)
        outs = []
        chunk = self.prefill_rows(P)
        for r0 in range(0, B, chunk):
            rows = slice(r0, min(B, r0 + chunk))
            outs.append(self._forward(tokens[rows], rows, self.pos, P, causal=True))
        self.pos.fill_(P)
        self._host_pos = P
        return torch.cat(outs, 0)

    @property
    def position(self) -> int:
        """The next decode step's position (the keys it reads: ``0..position``)."""
        return self._host_pos

    def seek(self, pos: int) -> None:
        """Decode the next step at ``pos`` (at most the current position): a benchmark timing the same steps twice.
        The cache's columns from ``pos`` on are written again by the steps that follow."""
        if not 0 < pos <= self._host_pos:
            raise ValueError(f"StaticDecoder.seek: position {pos} outside 1..{self._host_pos}")
        self.pos.fill_(pos)
        self._host_pos = pos

    def _full_rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t``, a view of the cache with ``L`` keys along ``dim``, widened to the ``rows_len`` keys its rows hold
        (``CACHE_ALIGN`` keys apart in memory)."""
        size = list(t.shape)
        size[dim] = self.rows_len
        return t.as_strided(size, t.stride(), t.storage_offset())

    def _step_eager(self, Lb: int) -> torch.Tensor:
        self.key_ok.index_fill_(1, self.pos, True)
        return self._forward(self.ids[:, None], slice(None), self.pos, Lb, causal=False)

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids [B]`` at the current position; returns logits [B, vocab] for the next one
        (a static buffer when graphs are on: consume it before the next step)."""
        self.ids.copy_(ids)
        Lb = self.bucket_len(self._host_pos + 1)
        if not self._gemm_tuned and self.device.type == "cuda":  # before the first step, eager or captured
            self._tune_gemms()
        if not self.use_graphs:
            out = self._step_eager(Lb)
        else:
            if Lb not in self.graphs:
                self._capture(Lb)
            self.graphs[Lb].replay()
            out = self.graph_outputs[Lb]
        self.pos.add_(1)
        self._host_pos += 1
        self._written = max(self._written, self._host_pos)
        return out

    def _tune_gemms(self) -> None:
        """Before the first decode step: where the decode step's FP8 linears run cuBLAS's block-FP8 GEMM (more than
        ``precision.small_m_max`` rows, e.g. batch 256 or a wave of 88), time DeepGEMM's kernel (where built:
        ``JETRL_DEEPGEMM_DIR``) and the small-M Triton GEMM against it per weight shape over all layers' weights and
        keep the fastest (``gemm.tune_kernels``; ``precision.decode_gemm=tune``). On the H200 at 256 rows DeepGEMM
        took the 8B QKV, attention output projection and fc2, cuBLAS kept fc1; on the H100 at 88 rows the small-M
        GEMM beat cuBLAS's on three of the four shapes (docs/benchmarks.md)."""
        from megatron_jetrl.precision.gemm import tune_kernels
        from megatron_jetrl.precision.linear import FP8LinearMixin

        self._gemm_tuned = True
        weights, state = {}, None
        for layer in self.layers:
            for m in layer.modules():
                if isinstance(m, FP8LinearMixin) and m.fp8_active() and m.fp8_backend == "scaled_mm":
                    state = m.fp8_state
                    q, sc = m.fp8_weight()
                    weights.setdefault(tuple(q.shape), []).append((q, sc))
        if (state is None or getattr(state, "decode_gemm", "tune") != "tune" or self.B <= state.small_m_max
                or self.exact):
            return
        t0 = time.perf_counter()
        self.gemm_tuning = tune_kernels(self.B, weights, state.recipe)
        if self.gemm_tuning:
            log.info("rollout decode: FP8 GEMM kernel per shape at batch %d (%.2f s): %s", self.B,
                     time.perf_counter() - t0, self.gemm_tuning)

    def _capture(self, Lb: int) -> None:
        """Warm up on a side stream (Triton/cuBLAS initialization), then capture one decode step.
        The warm-up writes the KV column and mask bit at the current position with the current ids:
        exactly what the replay that follows writes, so nothing needs restoring."""
        t0 = time.perf_counter()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step_eager(Lb)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._step_eager(Lb)
        self.graphs[Lb], self.graph_outputs[Lb] = g, out
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("rollout decode: captured a CUDA graph for batch %d, keys <= %d (%.2f s)", self.B, Lb, dt)
