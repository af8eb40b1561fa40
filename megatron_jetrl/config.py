"""One typed configuration tree for a run, loaded from YAML plus ``key.sub=value`` overrides.

Every section is a ``kw_only`` dataclass with a docstring per field and checks in
``__post_init__``; cross-section checks (TP dividing heads, ...) live in :class:`JetConfig`.
Errors are one line naming the field and the fix (:class:`ConfigError`). Each component gets only
its own section; nothing reads a global ``args``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from megatron_jetrl import env
from megatron_jetrl.errors import ConfigError  # noqa: F401  (raised here; importers take it from config too)
from megatron_jetrl.files import write_atomic

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def _fail(path: str, problem: str, fix: str) -> None:
    raise ConfigError(f"config error: {path}: {problem}; {fix}")


def _check(cond: bool, path: str, problem: str, fix: str) -> None:
    if not cond:
        _fail(path, problem, fix)


def _positive(obj: Any, section: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value is not None and value > 0, f"{section}.{name}", f"must be > 0, got {value!r}",
               "set a positive value")


# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ModelConfig:
    """The model, described as an HF ``config.json`` would (or read from one via ``hf_path``)."""

    model_type: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "qwen3"
    """HF ``model_type``; picks the layer spec and the Megatron<->HF name table."""
    hidden_size: int = 256
    """Model width."""
    num_layers: int = 2
    """Transformer layers (HF ``num_hidden_layers``)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """KV heads (query groups, GQA)."""
    head_dim: Optional[int] = None
    """Per-head width; defaults to hidden_size // num_attention_heads (qwen3 may differ)."""
    ffn_hidden_size: int = 512
    """Dense MLP width (HF ``intermediate_size``)."""
    vocab_size: int = 512
    """Vocabulary size (must be divisible by the tensor-parallel size)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Optional[dict] = None
    """RoPE frequency scaling as the HF config states it (``rope_scaling`` / ``rope_parameters`` without
    ``rope_theta``): ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}`` for Llama-3.1, ``linear`` or ``yarn`` (``models/rope_scaling.py``);
    None for plain RoPE. Read from ``hf_path`` and written back unchanged."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables are built for."""
    num_experts: Optional[int] = None
    """qwen3_moe: routed experts (HF ``num_experts``)."""
    moe_top_k: Optional[int] = None
    """qwen3_moe: experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """qwen3_moe: expert MLP width (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """qwen3_moe: renormalize the top-k router probabilities."""
    special_tokens: dict = field(default_factory=dict)
    """``bos_token_id`` / ``eos_token_id`` (an id or a list) / ``pad_token_id`` of the HF config.json, written back
    on export."""
    generation_config: Optional[dict] = None
    """The HF directory's ``generation_config.json`` (its eos ids end a rollout's responses; written back on export)."""
    hf_path: Optional[str] = None
    """HF model directory: its config.json (and generation_config.json) fill the fields above and its safetensors
    are loaded."""
    tokenizer: str = "builtin"
    """``builtin`` (the tiny preset's character tokenizer) or an HF tokenizer directory."""

    def __post_init__(self):
        if self.hf_path:
            cfg_file = os.path.join(self.hf_path, "config.json")
            _check(os.path.isfile(cfg_file), "model.hf_path", f"no config.json in {self.hf_path!r}",
                   "point model.hf_path at an HF model directory")
            with open(cfg_file) as f:
                for key, value in model_fields_from_hf(json.load(f)).items():
                    setattr(self, key, value)
            gen_file = os.path.join(self.hf_path, "generation_config.json")
            if os.path.isfile(gen_file):
                with open(gen_file) as f:
                    self.generation_config = json.load(f)
        _check(self.model_type in MODEL_TYPES, "model.model_type",
               f"unsupported model_type {self.model_type!r}", f"use one of {', '.join(MODEL_TYPES)}")
        _positive(self, "model", "hidden_size", "num_layers", "num_attention_heads",
                  "num_key_value_heads", "ffn_hidden_size", "vocab_size")
        if self.head_dim is None:
            _check(self.hidden_size % self.num_attention_heads == 0, "model.head_dim",
                   "hidden_size is not divisible by num_attention_heads", "set model.head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "model.num_key_value_heads",
               f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
               "use a divisor of the query heads")
        if self.model_type == "qwen3_moe":
            _check(bool(self.num_experts and self.moe_top_k and self.moe_ffn_hidden_size),
                   "model.num_experts", "qwen3_moe needs num_experts, moe_top_k and moe_ffn_hidden_size",
                   "set all three")
            _check(self.moe_top_k <= self.num_experts, "model.moe_top_k",
                   f"{self.moe_top_k} > num_experts={self.num_experts}", "lower moe_top_k")
        else:
            _check(self.num_experts is None, "model.num_experts",
                   f"{self.model_type} is dense", "remove num_experts or use model_type qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    def to_hf_config(self) -> dict:
        """The HF ``config.json`` dict of this model (inverse of ``model_fields_from_hf``)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[self.model_type]
        cfg = {
            "architectures": [arch], "model_type": self.model_type,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_hidden_size, "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": self.qkv_bias,
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        cfg.update(self.special_tokens)
        if self.is_moe:
            cfg.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                       num_experts_per_tok=self.moe_top_k,
                       moe_intermediate_size=self.moe_ffn_hidden_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
        return cfg


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def model_fields_from_hf(hf: dict) -> dict:
    """Map an HF ``config.json`` dict onto ``ModelConfig`` fields."""
    model_type = hf.get("model_type")
    _check(model_type in MODEL_TYPES, "model.hf_path",
           f"config.json has unsupported model_type {model_type!r}", f"use one of {', '.join(MODEL_TYPES)}")
    theta = hf.get("rope_theta")
    if theta is None:  # transformers >= 5 nests it
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    scaling = {k: v for k, v in (hf.get("rope_scaling") or hf.get("rope_parameters") or {}).items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    out = dict(
        model_type=model_type, hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], rope_theta=float(theta), rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        special_tokens={k: hf[k] for k in SPECIAL_TOKENS if hf.get(k) is not None},
    )
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 renamed it
        out.update(num_experts=experts, moe_top_k=hf["num_experts_per_tok"],
                   moe_ffn_hidden_size=hf["moe_intermediate_size"],
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)))
    return out


@dataclass(kw_only=True)
class PrecisionConfig:
    """Which precision flow the run uses; the numbers themselves live in ``FP8Recipe``."""

    mode: Literal["bf16", "fp8_rollout", "jet"] = "jet"
    """``bf16`` reference; ``fp8_rollout`` BF16 train + FP8 rollout (off-policy baseline);
    ``jet`` one FP8 flow for training and rollout."""
    scale_fmt: Literal["fp32", "ue8m0"] = "fp32"
    """Per-block scale format: fp32 (amax/448) or ue8m0 (power of two, rounded up)."""
    wgrad: Literal["fp8", "bf16"] = "fp8"
    """Weight-gradient GEMM precision in ``jet`` mode."""
    backend: Literal["auto", "scaled_mm", "emulated", "te"] = "auto"
    """FP8 GEMM backend: ``auto`` picks scaled_mm on Hopper+ and emulated elsewhere."""
    small_m_max: int = 64
    """Rollout forwards with at most this many tokens use the small-M Triton block-FP8 GEMM
    (``kernels/triton_gemm.py``) instead of cuBLAS ``scaled_mm``; 0 = off. 64 is the H200's crossover
    (docs/benchmarks.md, "Decode-size linears"); ``jetrl bench linear --decode`` prints it for your GPU. CUDA only
    (the CPU runs the emulated GEMM whatever this says)."""
    decode_gemm: Literal["tune", "cublas"] = "tune"
    """Static-decoder forwards above ``small_m_max`` rows (a 256-row rollout batch, a wave of 88 rows): ``tune``
    times cuBLAS's block-FP8 GEMM against the small-M Triton GEMM and DeepGEMM's (``kernels/deepgemm.py``; built
    with ``tools/build_deepgemm_sm90.py``, found through ``JETRL_DEEPGEMM_DIR``; without it, not timed) per weight
    shape at the decoder's row count, over all layers' weights, before the decoder's first step (once per row count
    and shape in a process), and runs each shape on the fastest (another kernel than cuBLAS only when more than 3%
    faster); ``cublas`` always cuBLAS. Same FP8 bytes and scales on every kernel; they round the fp32 accumulator to
    BF16 after summing in different orders (docs/benchmarks.md, "In-process rollout": the rollout time with and
    without; "Full RL step": the mismatch; "Rollouts past the GPU's memory": the small-M GEMM at 88 and 128 rows)."""
    fuse_swiglu: bool = True
    """Gated MLPs, every mode: FP8 fc2 runs the SwiGLU inside its activation quantizer (one pass over
    fc1's output, no BF16 activation written; same FP8 bytes as the unfused ops); BF16 fc2 gets a
    one-kernel SwiGLU each way (same forward bytes as megatron-core's eager silu * mul). false:
    megatron-core's unfused activation."""
    release_bf16_weights: bool = True
    """``jet`` training: free the BF16 copies of the FP8 linears' weights from the FP8 re-quantization to the
    next optimizer step (forward and backward read only the FP8 cache; the step writes the BF16 weights anew
    from the fp32 masters), as TransformerEngine's FP8 parameters do: 2 bytes per FP8-linear parameter off the
    forward/backward peak (9.8 GiB on 24 Llama-3.1-8B layers). Checkpoints restore them first. Needs a
    mixed-precision optimizer with standalone parameters (not megatron's distributed optimizer, whose
    parameters live in one buffer): elsewhere nothing is released."""
    cache_dgrad_weights: bool = True
    """``jet`` training: dgrad's FP8 GEMM reads the weight K-major (the transpose of the forward's bytes); make
    that copy once per step and share it across the micro-batches instead of one transpose per micro-batch
    (kept from the first backward to the end of the step's backward: 1 byte per FP8-linear parameter, less
    than ``release_bf16_weights`` frees)."""
    fuse_wgrad_accumulation: bool = True
    """Weight gradients in every mode: the wgrad GEMM adds its fp32 result straight into megatron's fp32
    ``main_grad`` (TransformerEngine's and APEX's gradient-accumulation fusion) instead of returning a
    gradient that the DDP hook adds in a second pass: the FP8 wgrad through cuBLASLt with beta = 1
    (``kernels/cublaslt.py``), megatron's BF16 linears (the LM head; all linears in bf16 / fp8_rollout)
    through ``torch.addmm`` with an fp32 output (``models/grad_accum.py``). Each falls back to the unfused
    path where it cannot run (cuBLAS < 12.9; BF16 parameters on CPU)."""
    params_dtype: Literal["bf16", "fp32"] = "bf16"
    """Model parameter dtype (fp32 master weights always live in the optimizer). The CPU
    embedded run and the parity tests use fp32."""
    exact: bool = False
    """Exact on-policy mode (``bf16`` or ``jet``, with ``kv_cache`` either way): every sampled token's logprob equals,
    bit for bit, the one the trainer's forward computes for it (``mismatch_abs_mean`` exactly 0). On a GPU the
    in-process rollout's static decoder and the trainer's forward run batch-invariant GEMMs and one causal attention
    kernel (a row's result does not depend on the rows, positions or sequences beside it), and both take the
    logprob with the fused logprob kernel (``log_softmax(logits.float() / temperature)`` on the CPU); the 8B RL
    step on an H100 costs 1.163x bf16's instead of the default jet's 1.241x (docs/benchmarks.md). On the CPU each token is
    decoded with the trainer's own forward over the batch padded to ``model.max_position_embeddings`` positions (no
    KV cache: slow by design). Needs ``rollout.engine=local`` or ``serve`` (``jetrl serve`` workers run the same
    kernels; the fleet starts them with ``--exact`` and refuses an attached worker without it) and
    ``parallel.tensor_parallel=1`` (docs/rollout.md, "Exact on-policy mode")."""
    kv_cache: Literal["bf16", "fp8"] = "bf16"
    """Attention keys and values. ``fp8``: the in-process rollout (``rollout.engine=local`` or ``serve``) keeps an
    E4M3 KV cache, K after RoPE and V quantized per token and KV head with a power-of-two scale (the rule in
    ``FP8Recipe.kv_cache``): half the bytes a long rollout's decode step reads. In ``jet`` the training forward's
    attention reads the same FP8 values (a quantize-dequantize of its K/V, straight-through in backward), so the
    cache stays on-policy; in ``fp8_rollout`` only the rollout uses it (the off-policy baseline). Not with
    ``rollout.engine=sglang``: SGLang 0.5.23's FP8 KV cache for these models holds one static scale per layer
    (``--kv-cache-dtype fp8_e4m3``, ``k_scale``/``v_scale`` from the checkpoint), which no per-token rule matches.
    docs/rollout.md, "FP8 KV cache"; docs/benchmarks.md has the speed and the mismatch."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron model parallelism; data parallel = world size / (tp * pp)."""

    tensor_parallel: int = 1
    """TP size (must divide heads, KV heads, FFN, vocab)."""
    pipeline_parallel: int = 1
    """PP size (must divide num_layers)."""
    expert_parallel: int = 1
    """EP size for qwen3_moe (must divide num_experts)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks when DP > 1."""
    recompute: Literal["none", "full"] = "none"
    """Activation recompute: ``full`` keeps only each layer's input and re-runs it in backward."""

    def __post_init__(self):
        _positive(self, "parallel", "tensor_parallel", "pipeline_parallel", "expert_parallel")


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling."""

    engine: Literal["local", "serve", "sglang"] = "local"
    """``local``: in-process engine over the trainer's model; ``serve``: a fleet of ``jetrl serve``
    processes (the in-process engine behind SGLang's HTTP API); ``sglang``: a fleet of SGLang servers."""
    n_samples_per_prompt: int = 8
    """Group size for GRPO."""
    prompts_per_step: int = 8
    """Prompts sampled per RL step."""
    max_new_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response, besides the tokenizer's eos and the checkpoint's eos ids
    (``generation_config.json``); responses that reach ``max_new_tokens`` instead are counted in
    ``truncated_fraction``."""
    num_servers: int = 1
    """Fleet: servers launched (ignored when ``server_addresses`` attaches to running ones)."""
    server_addresses: list[str] = field(default_factory=list)
    """Fleet: attach to these running servers (``http://host:port``) instead of launching."""
    launch_id: str = ""
    """Fleet: the launch's identity, set by ``jetrl launch`` (``--launch-id``; under Slurm the job id, its restart count
    and the step id). The trainer writes it to ``RUN_DIR/rollout/weights.launch`` once its initial weights are
    complete, and the launch's servers start when that file names their launch, however late their node starts.
    Empty: they wait for weights newer than the launch's config, so every node's launch must start before the trainer
    writes them."""
    server_tp: int = 1
    """Fleet: tensor-parallel size of each SGLang server."""
    mem_fraction: float = 0.8
    """SGLang ``--mem-fraction-static``."""
    weight_transport: Literal["disk", "distributed", "tensor"] = "distributed"
    """Fleet weight push: ``/update_weights_from_disk`` (HF dir in the run dir),
    ``/update_weights_from_distributed`` (broadcast group: NCCL, gloo on CPU) or
    ``/update_weights_from_tensor`` (buckets over HTTP)."""
    bucket_mb: int = 512
    """Fleet weight push bucket size."""
    chunk_size: int = 64
    """Fleet: prompts per ``/generate`` request (the unit that is retried on another server)."""
    request_timeout_s: float = 600.0
    """Fleet: seconds before a request counts as hung (the server is then restarted)."""
    health_timeout_s: float = 900.0
    """Fleet: seconds a launched server may take to become healthy."""
    max_restarts: int = 3
    """Fleet: restarts per server before the run fails."""
    deterministic: bool = False
    """SGLang ``--enable-deterministic-inference`` (batch-invariant kernels)."""
    router: bool = False
    """Put sglang-router (``pip install sglang-router``) in front of the servers: generation goes
    through it (its load balancing, retries, circuit breaker); weight updates go to every server."""
    admin_api_key: Optional[str] = None
    """Key for the servers' weight/memory endpoints (``--admin-api-key``); needed off loopback. None: the
    environment's ``JETRL_ADMIN_API_KEY`` (how ``jetrl launch`` hands the fleet's key to the trainer), else none.
    Servers a trainer starts get it off their command lines: SGLang's from ``RUN_DIR/admin/sglang_servers.yaml``
    (mode 0600, through its ``--config``), ``jetrl serve``'s as ``JETRL_ADMIN_API_KEY``. Prefer the environment
    variable: the run directory's ``config.yaml`` holds what this field holds."""
    decode: Literal["static", "megatron"] = "static"
    """In-process decoding: ``static`` (our static-shape KV cache over the model's own modules, CUDA
    graphs on GPU: ``rollout/decode.py``) or ``megatron`` (megatron-core's ``StaticInferenceContext``,
    eager; the reference the static decoder is tested against)."""
    cuda_graphs: bool = True
    """Static decoding on CUDA: capture each decode step in a CUDA graph (dense models)."""
    decode_bucket: int = 64
    """Static decoding with SDPA attention: a decode step reads the KV cache up to the next multiple of
    this (one CUDA graph per multiple). Smaller buckets read fewer padded keys per step and capture more
    graphs once (docs/benchmarks.md, "In-process rollout": 64 against 256 on the H200)."""
    decode_max_graphs: int = 32
    """Static decoding with SDPA attention: at most this many length buckets (CUDA graphs) per decoder; for long
    contexts the bucket widens to a multiple of ``decode_bucket`` (e.g. 1024 keys at 32K positions) instead of
    capturing hundreds of graphs (each takes a fraction of a second for an 8B model). 0: no limit."""
    decode_attention: Literal["sdpa", "triton"] = "sdpa"
    """Static decoding on CUDA, a decode step's attention: ``sdpa`` (default: torch SDPA over the bucket
    with a mask, the kernel family the trainer's attention runs) or ``triton`` (``kernels/decode_attn.py``:
    reads keys up to the step's position only, one CUDA graph for every length; its rounding is independent
    of the trainer's attention, so the train-rollout mismatch is higher: docs/benchmarks.md, "Decode
    attention"). Prefill always runs SDPA. With ``precision.kv_cache=fp8`` decode steps run the Triton kernel
    whatever this says (SDPA reads no FP8)."""
    fp8_kv_v_layout: Literal["auto", "rows", "key_major"] = "auto"
    """With ``precision.kv_cache=fp8``, how the in-process decoder stores V: ``rows`` ([positions, d] per KV head: a
    step writes each value as one contiguous 128-byte row), ``key_major`` ([d, positions]: the decode attention's
    P.V tiles contiguous along the keys, fewer instructions per key, 4 programs per SM instead of 2; a step writes one
    byte per feature row), or ``auto``: ``key_major`` on GPUs with at least 30 GB/s of memory bandwidth per SM
    (H200: 37; its 8B rollout at batch 64 ran 2% faster at 4K and 5% at 8K new tokens with ``key_major``), ``rows``
    below that and where the bandwidth is unknown (H100 SXM: 25; 3.5% faster at 4K with ``rows``). Exact mode always
    stores V key-major (its attention, the trainer's too, reads that layout). docs/decode_attention.md."""
    decode_rows: int = 0
    """In-process engine (``local``, and each ``jetrl serve`` worker): the most rows (prompts x samples) decoded at
    once; a larger batch decodes in waves of at most this many rows, balanced (512 rows at 200: 3 waves of 176,
    multiples of 8). 0: all at once where their KV cache fits the GPU's free memory, else waves of the most rows
    that fit, with a log line (a long rollout then need not shrink ``prompts_per_step``; the FP8 cache,
    ``precision.kv_cache=fp8``, holds twice the rows per wave). Row-seeded sampling (the fleet's per-prompt
    seeds) draws each row's tokens from its own seed whatever the waves (the same tokens up to the GEMMs' rounding
    at another row count; with ``precision.exact`` bit for bit)."""
    keep_decode_cache: bool = True
    """Keep the static decoder's KV cache and graphs between rollouts (no re-capture per step);
    ``false`` frees them after every rollout (memory for training on a full GPU), and every rollout then
    captures its graphs again (seconds for an 8B model: one graph per bucket; a larger ``decode_bucket``
    captures fewer)."""

    def __post_init__(self):
        _positive(self, "rollout", "decode_bucket", "n_samples_per_prompt", "prompts_per_step", "max_new_tokens", "num_servers",
                  "server_tp", "bucket_mb", "chunk_size", "request_timeout_s", "health_timeout_s")
        _check(0 < self.mem_fraction < 1, "rollout.mem_fraction", f"{self.mem_fraction} not in (0, 1)", "use e.g. 0.8")
        _check(self.decode_rows >= 0, "rollout.decode_rows", f"must be >= 0, got {self.decode_rows}",
               "use 0 (as many as fit) or a row count")
        _check(self.decode_max_graphs >= 0, "rollout.decode_max_graphs", f"must be >= 0, got {self.decode_max_graphs}",
               "use e.g. 32 (0: no limit)")
        for a in self.server_addresses:
            _check(a.startswith(("http://", "https://")), "rollout.server_addresses", f"{a!r} is not a URL",
                   "write http://host:port")
        _check(re.fullmatch(r"[A-Za-z0-9._-]*", self.launch_id) is not None, "rollout.launch_id",
               f"{self.launch_id!r} holds other characters than letters, digits, '.', '_' and '-'",
               "use e.g. the scheduler's job id")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0", "use 0 for greedy")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"{self.top_p} not in (0, 1]", "use a value in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0", "use 0 to disable")


@dataclass(kw_only=True)
class AlgoConfig:
    """GRPO / PPO-clip objective and the optimizer."""

    lr: float = 1e-5
    """Peak learning rate."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    fused_adam: bool = True
    """When megatron-core falls back to torch's Adam (no TransformerEngine/apex FusedAdam), run it
    as torch's fused single-kernel Adam instead of the per-tensor foreach loop."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    clip_eps_low: float = 0.2
    """PPO ratio lower clip."""
    clip_eps_high: float = 0.2
    """PPO ratio upper clip (DAPO clip-higher when larger than low)."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient (0 = no reference model)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: DAPO token mean or per-sequence mean."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling cap C (fp8_rollout mode); None = off."""
    micro_batch_size: int = 8
    """Sequences per forward/backward micro-batch."""
    pad_tokens_to: int = -1
    """Right-pad each micro-batch's sequences (pad positions are masked out: logprobs, loss, gradients of
    the real tokens and metrics are those of the unpadded batch) so a micro-batch holds a multiple of this
    many tokens. 0 = off. -1 (auto) = FP8 training (``jet``) on a GPU: 16, the row alignment of cuBLAS's
    block-scaled GEMMs (otherwise every forward and dgrad GEMM pads a copy of its activation operand; the
    weight-gradient GEMM's token dimension is padded to 512 inside the quantizers' buffers whatever this is);
    off elsewhere. Never past ``model.max_position_embeddings``."""
    recompute_logprobs: bool = False
    """Where the PPO ratio's old logprobs come from. ``false`` (default): each micro-batch's own training
    forward, detached. The RL step makes one optimizer step per rollout batch, so the policy of that
    forward is the old policy: the ratio is exactly 1 (``clip_fraction`` 0), the gradient is the same,
    and the train-rollout mismatch and TIS weights come from the same logprobs; one forward pass per
    step less (docs/benchmarks.md, "Full RL step"). ``true``: a
    separate forward pass before training (``time_logprob``; the training phase as the Jet-RL paper
    times it, and what a loop with several optimizer steps per batch would need)."""
    sft_warmup_steps: int = 0
    """Supervised steps on (prompt, answer) before RL (the tiny preset uses a short warm-up)."""
    sft_lr: Optional[float] = None
    """Learning rate of the warm-up steps (default: ``lr``)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After ``lr_warmup_steps``: hold ``lr``, or decay it to ``min_lr`` by the last step (linear or cosine)."""
    min_lr: float = 0.0
    """Where ``linear`` / ``cosine`` end."""
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    """``grpo``: reward minus the group mean, over the group std; ``dr_grpo`` (Dr. GRPO): without the std."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (its rows split in this many parts); above 1 the old logprobs come from a
    forward before the first update, so the PPO ratio and its clipping act from the second part on."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no gradient) and draw more prompts
    until ``rollout.prompts_per_step`` groups remain or ``max_sampling_rounds`` rollouts were made
    (``filtered_groups``, ``sampling_rounds``)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: rollouts per step at most (the last round's groups fill what is missing, filtered or not)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: responses within this many tokens of ``rollout.max_new_tokens`` lose up to
    ``overlong_penalty`` reward, linearly (0 = off)."""
    overlong_penalty: float = 1.0
    """The reward lost at ``rollout.max_new_tokens`` tokens."""
    max_skipped_steps: int = 3
    """A step whose loss or gradients are not finite skips its update (``skipped_steps`` counts them);
    this many skipped in a row stop the run, with the last checkpoint (all finite) still ``latest``."""

    def __post_init__(self):
        _positive(self, "algo", "lr", "micro_batch_size", "max_skipped_steps", "mini_batches", "max_sampling_rounds")
        _check(self.min_lr <= self.lr, "algo.min_lr", f"{self.min_lr} > algo.lr={self.lr}", "use min_lr <= lr")
        for name in ("sft_warmup_steps", "lr_warmup_steps", "grad_clip", "clip_eps_low", "clip_eps_high", "kl_coef",
                     "min_lr", "overlong_buffer", "overlong_penalty",
                     "entropy_coef", "weight_decay"):
            _check(getattr(self, name) >= 0, f"algo.{name}", f"must be >= 0, got {getattr(self, name)!r}",
                   "give a non-negative value")
        _check(self.sft_lr is None or self.sft_lr > 0, "algo.sft_lr", f"must be > 0, got {self.sft_lr!r}",
               "give a positive learning rate or null (= algo.lr)")
        _check(self.pad_tokens_to >= -1, "algo.pad_tokens_to", f"{self.pad_tokens_to} < -1",
               "use -1 (auto), 0 (off) or a positive token multiple such as 512")
        _check(self.tis_cap is None or self.tis_cap >= 1.0, "algo.tis_cap",
               f"{self.tis_cap} < 1", "use a cap >= 1 (e.g. 2.0) or null")


@dataclass(kw_only=True)
class SchedulerConfig:
    """How rollout and training share hardware."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """Same GPUs, alternating (colocated) or separate pools (disaggregated)."""
    offload_trainer: bool = True
    """Colocated with a fleet: move the trainer's params, grads and optimizer state to host memory
    during rollout (the servers release theirs during training)."""
    async_rollout: bool = False
    """Disaggregated: generate step t+1's rollouts (with the weights of step t) while step t trains;
    the staleness is logged as ``rollout_staleness``."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompts and rewards."""

    path: Union[str, list[str], None] = None
    """JSONL or Parquet prompt file(s), read in order; None uses the built-in synthetic task."""
    val_path: Union[str, list[str], None] = None
    """Held-out prompt file(s) for ``eval``; None with the synthetic task: ``val_size`` prompts of its own."""
    val_size: int = 64
    """Synthetic task: held-out prompts (another seed than the training ones)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages; a dotted path reaches a nested column."""
    answer_key: str = "answer"
    """Column holding the reference answer (dotted for nested: ``reward_model.ground_truth``)."""
    apply_chat_template: Union[Literal["auto"], bool] = "auto"
    """Render prompts with the HF tokenizer's chat template (with the generation prompt): ``auto`` when it has
    one, ``true`` (an error without one), ``false`` (raw text; chat-message prompts are then refused)."""
    system_prompt: Optional[str] = None
    """A system message put before string prompts when the chat template applies."""
    reward: str = "math"
    """Reward function name in the reward registry: ``math`` (numeric answer match), ``exact`` (whole
    response), ``hash`` (pseudo-random in [0, 1), for speed benchmarks on random weights), or one registered
    with ``megatron_jetrl.rewards.register_reward``."""
    synthetic_size: int = 2000
    """Prompts generated for the built-in synthetic task (when ``path`` is None)."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation (``data.val_path``, or the synthetic task's own held-out prompts)."""

    interval: int = 0
    """Evaluate before the first RL step, every N RL steps after it, and after the last one (0 = never). Each
    evaluation is logged with the step it precedes: the one after the last RL step in a row of its own, at the
    step one past the last (its ``eval/*`` metrics only)."""
    greedy: bool = True
    """``eval/accuracy``: mean reward of one greedy response per prompt."""
    n_samples: int = 0
    """>= 2: also ``eval/pass@k`` (k = n_samples): a prompt counts when any of k samples at
    ``rollout.temperature`` earns reward 1."""
    max_prompts: int = 0
    """Evaluate the first N held-out prompts (0 = all)."""

    def __post_init__(self):
        _check(self.interval >= 0 and self.n_samples >= 0 and self.max_prompts >= 0, "eval",
               "interval, n_samples and max_prompts must be >= 0", "use 0 to turn one off")
        _check(self.n_samples != 1, "eval.n_samples", "pass@1 is eval/accuracy's job", "use 0 or >= 2")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint cadence and resume."""

    save_interval: int = 0
    """Save after every N-th step of the loop, the supervised warm-up steps counted (0 = only at the end)."""
    keep_last: int = 0
    """Keep the newest N checkpoints of the run: once a save is complete, older ``checkpoints/step_*`` directories
    are deleted (0 = keep every one). A 70B checkpoint with its Adam state is about a terabyte."""
    resume: bool = False
    """Resume from the newest intact checkpoint in the run directory (an error when there is none; the
    model, seed and precision mode must be the checkpoint's)."""
    overwrite: bool = False
    """Start a fresh run in a run directory that holds another run's checkpoints or metrics, deleting them
    (``jetrl train --overwrite``); without it such a directory is refused."""
    load_path: Optional[str] = None
    """Start from the model weights of a megatron-core checkpoint (e.g. ``jetrl convert
    hf-to-megatron``'s output, any TP/PP layout: each rank reads only its shard); the optimizer
    starts fresh. Ignored when resuming."""

    def __post_init__(self):
        _check(self.save_interval >= 0, "checkpoint.save_interval", f"must be >= 0, got {self.save_interval}",
               "use 0 (only at the end) or a positive step count")
        _check(self.keep_last >= 0, "checkpoint.keep_last", f"must be >= 0, got {self.keep_last}",
               "use 0 (keep every checkpoint) or how many of the newest to keep")
        _check(not (self.resume and self.overwrite), "checkpoint.overwrite", "given with checkpoint.resume",
               "resume (keep the run) or overwrite (start again), not both")


@dataclass(kw_only=True)
class LoggingConfig:
    """Where the run writes."""

    run_dir: str = "runs/latest"
    """Run directory: config.yaml, metrics.jsonl, tb/, checkpoints/."""
    tensorboard: bool = True
    """Write TensorBoard scalars under run_dir/tb."""
    parity_interval: int = 1
    """Check the FP8 weight hash parity of the hand-over every N RL steps (0 = never). Hashing copies
    the FP8 weights to the CPU: on large models use e.g. 50."""

    def __post_init__(self):
        _check(self.parity_interval >= 0, "logging.parity_interval", "must be >= 0", "use 0 to disable")


@dataclass(kw_only=True)
class JetConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    steps: int = 10
    """RL steps."""
    seed: int = 1234
    """Global seed."""
    gc_freeze: bool = True
    """After setup, move every Python object alive then (torch, megatron-core, the model, the optimizer: ~0.4M
    objects) into the interpreter's permanent generation (``gc.freeze``), so Python's periodic full garbage
    collections stop re-scanning them (each such pass takes a fraction of a second and lands inside a phase at
    random). Undone at close; false keeps Python's default."""

    def __post_init__(self):
        _positive(self, "", "steps")
        m, p = self.model, self.parallel
        tp = p.tensor_parallel
        for name in ("num_attention_heads", "num_key_value_heads", "ffn_hidden_size", "vocab_size"):
            value = getattr(m, name)
            _check(value % tp == 0, "parallel.tensor_parallel",
                   f"{tp} does not divide model.{name}={value}", f"choose a tensor_parallel dividing {value}")
        _check(m.num_layers % p.pipeline_parallel == 0, "parallel.pipeline_parallel",
               f"{p.pipeline_parallel} does not divide model.num_layers={m.num_layers}",
               "choose a pipeline_parallel dividing the layer count")
        if p.expert_parallel > 1:
            _check(m.is_moe, "parallel.expert_parallel", f"{m.model_type} has no experts",
                   "set expert_parallel=1")
            _check(m.num_experts % p.expert_parallel == 0, "parallel.expert_parallel",
                   f"{p.expert_parallel} does not divide model.num_experts={m.num_experts}",
                   "choose an expert_parallel dividing the expert count")
        if m.is_moe:
            _check(m.moe_ffn_hidden_size % tp == 0, "parallel.tensor_parallel",
                   f"{tp} does not divide model.moe_ffn_hidden_size", "choose a smaller tensor_parallel")
        _check(self.scheduler.mode == "colocated" or self.rollout.engine != "local", "scheduler.mode",
               "disaggregated needs a server fleet", "set rollout.engine=serve or sglang")
        _check(not (self.algo.dynamic_sampling and self.scheduler.async_rollout), "algo.dynamic_sampling",
               "draws more rollouts within a step, the one-step-ahead rollout draws one", "set scheduler.async_rollout=false")
        _check(self.algo.overlong_buffer < self.rollout.max_new_tokens, "algo.overlong_buffer",
               f"{self.algo.overlong_buffer} >= rollout.max_new_tokens={self.rollout.max_new_tokens}",
               "use a buffer shorter than the longest response")
        _check(not self.scheduler.async_rollout or self.scheduler.mode == "disaggregated", "scheduler.async_rollout",
               "one-step-ahead rollout needs separate rollout GPUs", "set scheduler.mode=disaggregated")
        _check(self.rollout.engine == "local" or self.rollout.weight_transport == "disk" or p.pipeline_parallel == 1,
               "rollout.weight_transport", f"{self.rollout.weight_transport} sends from one rank; pipeline stages "
               "each hold their own layers", "use rollout.weight_transport=disk with pipeline_parallel > 1")
        if self.precision.exact:
            _check(self.rollout.engine != "sglang", "precision.exact", "rollout.engine=sglang samples with SGLang's "
                   "kernels, not the trainer's", "use rollout.engine=local or serve, or precision.exact=false")
            _check(p.tensor_parallel == 1, "precision.exact", "the exact logprob is taken over the whole vocabulary "
                   "on one rank", "use parallel.tensor_parallel=1, or precision.exact=false")
            _check(self.precision.backend != "te", "precision.exact", "TransformerEngine's kernels are not "
                   "batch-invariant", "use precision.backend=auto, or precision.exact=false")
            _check(self.precision.mode != "fp8_rollout", "precision.exact", "fp8_rollout samples in another precision "
                   "than it trains", "use precision.mode=jet or bf16")
        if self.precision.kv_cache == "fp8":
            _check(self.precision.mode != "bf16", "precision.kv_cache", "fp8 is an FP8 precision flow, mode is bf16",
                   "set precision.mode=jet (unified) or fp8_rollout, or precision.kv_cache=bf16")
            _check(self.rollout.engine != "sglang", "precision.kv_cache", "SGLang 0.5.23's FP8 KV cache keeps one static "
                   "scale per layer, not the per-token rule the trainer applies", "use rollout.engine=local or serve, "
                   "or precision.kv_cache=bf16")
            _check(self.precision.backend != "te", "precision.kv_cache", "fp8 is applied by our SDPA attention, which "
                   "the TransformerEngine model does not use", "use precision.backend=auto or precision.kv_cache=bf16")
        if self.rollout.engine == "sglang":
            from megatron_jetrl.precision.recipe import FP8Recipe

            _check(self.rollout.weight_transport != "tensor", "rollout.weight_transport",
                   "tensor sends base64 safetensors buckets, which only jetrl serve reads; SGLang 0.5.23's "
                   "/update_weights_from_tensor takes CUDA IPC handles (same host and GPU only)",
                   "use rollout.weight_transport=distributed (or disk) with rollout.engine=sglang")
            why = FP8Recipe.from_config(self.precision).sglang_tp_problem(
                heads=m.num_attention_heads, kv_heads=m.num_key_value_heads, head_dim=m.head_dim,
                ffn=m.ffn_hidden_size, tp=self.rollout.server_tp)
            _check(why is None, "rollout.server_tp", f"SGLang 0.5.23 refuses this model: {why}",
                   "choose a server_tp it allows (jetrl launch picks one)")
        if self.precision.backend == "te":
            from megatron_jetrl.precision.recipe import FP8Recipe
            from megatron_jetrl.precision.te_backend import TEConfigError, check_te_numerics

            try:
                check_te_numerics(FP8Recipe.from_config(self.precision), m, env.snapshot())
            except TEConfigError as e:
                raise ConfigError(f"config error: {e}") from None
            _check(self.precision.mode != "jet" or all(
                x % (128 * tp) == 0 for x in (m.ffn_hidden_size, m.num_key_value_heads * m.head_dim)),
                "precision.backend", "TE's FP8 gate/up and k/v shards must be whole 128-row blocks",
                "use a tensor_parallel with ffn/TP and kv_heads*head_dim/TP multiples of 128, or backend=auto")
        _check(self.algo.tis_cap is None or self.precision.mode == "fp8_rollout", "algo.tis_cap",
               f"truncated importance sampling is for fp8_rollout, mode is {self.precision.mode}",
               "set algo.tis_cap=null or precision.mode=fp8_rollout")


# --------------------------------------------------------------------------------------------
# Loading: dict -> typed tree, with one-line errors.

def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for i, t in enumerate(inner):  # the first member type the value fits
            try:
                return _coerce(value, t, path)
            except ConfigError:
                if i == len(inner) - 1:
                    raise
    if origin is Literal:
        choices = typing.get_args(tp)
        _check(value in choices, path, f"{value!r} is not one of {list(choices)}",
               f"use one of {', '.join(map(str, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), path, f"expected a mapping, got {type(value).__name__}",
               "give a YAML mapping")
        return _build(tp, value, path)
    if tp is bool:
        _check(isinstance(value, bool), path, f"expected true/false, got {value!r}", "use true or false")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), path,
               f"expected an integer, got {value!r}", "give an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path,
               f"expected a number, got {value!r}", "give a number")
        _check(math.isfinite(value), path, f"{value!r} is not finite", "give a finite number")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), path, f"expected a string, got {value!r}", "quote the value")
        return value
    return value


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in names:
            _fail(path, "unknown key", f"valid keys here: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        _check(isinstance(node, dict), dotted, "is not a section", "override a leaf key")
    node[keys[-1]] = value


PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs")


def preset_path(name: str) -> str:
    """The YAML file of a preset shipped in ``examples/configs`` (exits with one line naming the ones there)."""
    path = os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        have = sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml")) if os.path.isdir(PRESET_DIR) else []
        raise SystemExit(f"jetrl: unknown preset {name!r}; available: {', '.join(have) or 'none'}")
    return path


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> JetConfig:
    """YAML file (optional) + ``a.b=value`` overrides (values parsed as YAML) -> ``JetConfig``."""
    data: dict = {}
    if path:
        _check(os.path.isfile(path), "--config", f"file {path!r} not found", "give an existing YAML file")
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            _fail("--config", f"{path} is not valid YAML{where} ({getattr(e, 'problem', None) or type(e).__name__})",
                  "fix the file")
        _check(isinstance(data, dict), "--config", "top level is not a mapping", "write key: value pairs")
    for item in overrides:
        _check("=" in item, item, "override without '='", "write key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            _fail(key.strip(), f"{raw!r} is not a valid YAML value ({getattr(e, 'problem', None) or type(e).__name__})",
                  "quote strings, write lists as [a,b]")
        _set_path(data, key.strip(), value)
    return _build(JetConfig, data)


def parallel_from_overrides(overrides) -> ParallelConfig:
    """Only ``parallel.*=value`` overrides -> ParallelConfig (the converters' layout argument)."""
    data: dict = {}
    for item in overrides:
        _check("=" in item and item.startswith("parallel."), item, "not a parallel.* override",
               "write parallel.tensor_parallel=2 (or pipeline_parallel / expert_parallel)")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), yaml.safe_load(raw))
    return _build(ParallelConfig, data.get("parallel", {}), "parallel")


def config_to_dict(cfg: JetConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: JetConfig, path: str) -> None:
    """Write the resolved config as YAML, atomically (``files.write_atomic``): every node's ``jetrl launch`` writes
    the run's config into the shared run directory at the same time, and every node's trainer reads it (0644)."""
    write_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
