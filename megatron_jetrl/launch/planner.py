"""Per-GPU memory estimates and the layout search behind ``jetrl launch``.

All figures are bytes (GB = 1e9, as GPUs are sold). The model is described by ``ModelConfig``.

Trainer, per GPU of the fullest pipeline stage (the first holds the embedding and the most
micro-batches in flight, the last the output layer; with PP=1 one stage holds both):

- parameters: the stage's share (linears split by TP, experts by EP) x 2 B (bf16) or 4 B (fp32);
- gradients: Megatron's fp32 ``main_grad`` buffers, 4 B per parameter;
- optimizer: fp32 master weights + Adam moments, 12 B per parameter (8 B when the parameters are
  already fp32), divided by DP with the distributed optimizer;
- FP8 weight cache (``jet``, ``fp8_rollout``): 1 B per linear parameter (+ fp32 block scales);
- activations for one micro-batch of ``T = micro_batch x seq_len`` tokens per layer, counted tensor
  by tensor (bf16; SDPA keeps no s^2 scores): both norm inputs and outputs (4 x 2TH), the q/k/v
  outputs and the attention output (2T(q + 2kv + q)/TP), the SwiGLU fc1 output and its product
  (2T(2F + F)/TP). In ``jet`` the four linear inputs are kept in FP8 (1 B). With ``recompute=full``
  a layer keeps only its input (2TH) plus one layer's full set during its backward. The first stage
  holds ``pp`` micro-batches in flight (1F1B);
- logits on the last stage: T x V/TP x 4 B for the fp32 cross-entropy, twice (values + gradient);
- a fixed 3 GB (CUDA context, NCCL buffers) and 5% for fragmentation.

SGLang, per GPU of one server with ``server_tp`` GPUs: FP8 (or BF16) weights / server_tp, and a KV
pool of ``concurrency x context_len`` tokens at 2 (K, V) x layers x kv_heads/server_tp x head_dim x 2 B;
SGLang's ``mem_fraction_static`` must hold both. With the FP8 KV cache (``precision.kv_cache=fp8``, ``jetrl
serve`` only) a token's K and V take 1 B per element and one fp32 scale per KV head each (the recipe's KV rule):
2 x layers x kv_heads x (head_dim + 4) B.

Colocated peak = max(training, rollout, the weight push: the trainer resident + the servers'
weights, their KV pool still released).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_jetrl.precision.recipe import kv_cache_bytes

GB = 1e9
OVERHEAD = 3 * GB
FRAGMENTATION = 1.05


class PlanError(ValueError):
    """The cluster cannot run this config; one line naming the knob to change."""


@dataclass
class ParamCounts:
    embed: int
    lm_head: int
    layer_linear: int      # FP8-able linears of one layer (dense part)
    layer_expert: int      # expert linears of one layer (all experts)
    layer_other: int       # norms, biases, router of one layer
    final_norm: int
    layers: int

    @property
    def total(self) -> int:
        return self.embed + self.lm_head + self.final_norm + self.layers * (
            self.layer_linear + self.layer_expert + self.layer_other)

    @property
    def linear_total(self) -> int:
        return self.layers * (self.layer_linear + self.layer_expert)


def param_counts(m) -> ParamCounts:
    H, hd = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * hd, m.num_key_value_heads * hd
    attn = H * (q + 2 * kv) + q * H
    other = 2 * H + (2 * hd if m.qk_norm else 0) + ((q + 2 * kv) if m.qkv_bias else 0)
    if m.is_moe:
        mlp, expert = 0, m.num_experts * 3 * H * m.moe_ffn_hidden_size
        other += H * m.num_experts  # router
    else:
        mlp, expert = 3 * H * m.ffn_hidden_size, 0
    embed = m.vocab_size * H
    return ParamCounts(embed, 0 if m.tie_word_embeddings else embed, attn + mlp, expert, other, H, m.num_layers)


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1


@dataclass
class TrainerMemory:
    params: float
    grads: float
    optimizer: float
    fp8_cache: float
    activations: float
    logits: float
    total: float = field(init=False)

    def __post_init__(self):
        self.total = (self.params + self.grads + self.optimizer + self.fp8_cache + self.activations + self.logits
                      + OVERHEAD) * FRAGMENTATION

    def rows(self) -> dict[str, float]:
        return {k: getattr(self, k) / GB for k in ("params", "grads", "optimizer", "fp8_cache", "activations",
                                                  "logits", "total")}


def stage_params(pc: ParamCounts, lay: Layout) -> tuple[float, float]:
    """(parameters, FP8-able linear parameters) on one GPU of the fullest stage."""
    per_stage_layers = pc.layers // lay.pp
    dense = per_stage_layers * (pc.layer_linear / lay.tp + pc.layer_other)
    experts = per_stage_layers * pc.layer_expert / lay.ep
    ends = (pc.embed + pc.lm_head) / lay.tp if lay.pp == 1 else max(pc.embed, pc.lm_head) / lay.tp
    linear = per_stage_layers * (pc.layer_linear / lay.tp + pc.layer_expert / lay.ep)
    return dense + experts + ends + pc.final_norm, linear


def layer_activation_bytes(m, tokens: int, tp: int, jet: bool) -> float:
    H, hd, F = m.hidden_size, m.head_dim, (m.moe_ffn_hidden_size * m.moe_top_k if m.is_moe else m.ffn_hidden_size)
    q, kv = m.num_attention_heads * hd, m.num_key_value_heads * hd
    norms = 4 * 2 * H                     # two norms: input and output each
    attn = 2 * (q + 2 * kv + q) / tp      # q, k, v and the attention output
    mlp = 2 * (2 * F + F) / tp            # fc1 output (gate, up) and the SwiGLU product
    per_token = norms + attn + mlp
    if jet:                               # the linear inputs (2 norm outputs, attn out, SwiGLU out) in FP8
        per_token -= H + H + q / tp + F / tp
    return tokens * per_token


def trainer_memory(m, lay: Layout, *, mode: str, params_dtype: str, micro_batch: int, seq_len: int,
                   recompute: str, distributed_optimizer: bool) -> TrainerMemory:
    pc = param_counts(m)
    p, linear = stage_params(pc, lay)
    bytes_param = 2 if params_dtype == "bf16" else 4
    opt = (12 if params_dtype == "bf16" else 8) * p / (lay.dp if distributed_optimizer and lay.dp > 1 else 1)
    fp8 = linear * (1 + 4 / (128 * 128)) if mode in ("jet", "fp8_rollout") else 0.0
    T = micro_batch * seq_len
    layers = pc.layers // lay.pp
    full = layer_activation_bytes(m, T, lay.tp, mode == "jet")
    if recompute == "full":
        act = layers * 2 * T * m.hidden_size + full
    else:
        act = layers * full
    act *= min(lay.pp, 8) if lay.pp > 1 else 1
    logits = 2 * T * (m.vocab_size / lay.tp) * 4
    return TrainerMemory(bytes_param * p, 4 * p, opt, fp8, act, logits)


@dataclass
class ServerMemory:
    weights: float
    kv_per_token: float
    kv_pool: float
    budget: float

    @property
    def fits(self) -> bool:
        return self.weights + self.kv_pool <= self.budget


def server_memory(m, server_tp: int, *, fp8: bool, concurrency: int, context_len: int, mem_fraction: float,
                  gpu_mem: float, kv_fp8: bool = False) -> ServerMemory:
    """One rollout server's memory per GPU: ``fp8`` FP8 linear weights, ``kv_fp8`` the FP8 KV cache (E4M3 K/V and
    an fp32 scale per token and KV head for each)."""
    pc = param_counts(m)
    weights = (pc.linear_total * (1 + 4 / (128 * 128) if fp8 else 2)
               + 2 * (pc.embed + pc.lm_head + pc.final_norm + pc.layers * pc.layer_other)) / server_tp
    kv_heads = max(1, m.num_key_value_heads // server_tp)
    kv_per_token = kv_cache_bytes(1, layers=m.num_layers, kv_heads=kv_heads, head_dim=m.head_dim, fp8=kv_fp8)
    return ServerMemory(weights, kv_per_token, concurrency * context_len * kv_per_token, mem_fraction * gpu_mem)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp(m, tp: int, mode: str) -> bool:
    ok = all(x % tp == 0 for x in (m.num_attention_heads, m.num_key_value_heads, m.ffn_hidden_size, m.vocab_size))
    if ok and mode != "bf16":  # FP8 sub-matrices of each TP shard in whole 128-row blocks
        ok = (m.num_key_value_heads * m.head_dim // tp) % 128 == 0 and (m.ffn_hidden_size // tp) % 128 == 0
    return ok


def search_layouts(m, gpus: int, gpus_per_node: int, fits, fixed_tp: int = 0, fixed_pp: int = 0):
    """Candidate (tp, pp, dp) in order of preference: TP within a node, the least model parallelism
    (most data parallelism), then the smaller PP; ``fits(layout) -> (ok, detail)``. Returns
    (first fitting layout, [(layout, detail) of every candidate tried])."""
    tried = []
    tps = [fixed_tp] if fixed_tp else [t for t in _divisors(gpus_per_node)]
    pps = [fixed_pp] if fixed_pp else _divisors(m.num_layers)
    cands = sorted(((tp, pp) for tp in tps for pp in pps if gpus % (tp * pp) == 0),
                   key=lambda c: (c[0] * c[1], c[1]))
    for tp, pp in cands:
        lay = Layout(tp, pp, gpus // (tp * pp))
        ok, detail = fits(lay)
        tried.append((lay, detail))
        if ok:
            return lay, tried
    return None, tried
