"""Helpers the tests share: the repository path, an independent float64 statement of the FP8 rule,
test data, megatron-core DDP checks, GPU test inputs."""
import os
import numpy as np
import pytest
import torch

F32 = np.float32


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Round float64 values (|v| <= 448) to E4M3 (bias 7, 3 mantissa bits, subnormal step 2^-9),
    ties to even; written from the format's definition, not from torch's cast."""
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    exp = np.maximum(e - 1, -6)
    quantum = np.exp2(exp - 3.0)
    return np.sign(v) * np.rint(a / quantum) * quantum


def reference_blocks(x: np.ndarray, br: int, bc: int, scale_fmt: str):
    """The numerics contract in float64 with float32 rounding where the rule says fp32."""
    rows, cols = x.shape
    x = x.astype(F32).astype(np.float64)
    rb, cb = -(-rows // br), -(-cols // bc)
    q = np.zeros_like(x)
    s = np.zeros((rb, cb))
    inv448 = float(F32(1.0 / 448.0))
    for i in range(rb):
        for j in range(cb):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = max(float(F32(1e-10)), float(np.abs(blk).max()))
            if scale_fmt == "fp32":
                scale_inv = float(F32(amax * inv448))
                mult = float(F32(448.0 / amax))
            else:
                y = float(F32(amax * inv448))
                m, e = np.frexp(y)
                e = e - 1 if m == 0.5 else e
                scale_inv, mult = 2.0 ** e, 2.0 ** -e
            scaled = np.clip((blk * mult).astype(F32).astype(np.float64), -448, 448)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3_rne(scaled)
            s[i, j] = scale_inv
    return q, s


def wide_data(shape, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    if outliers:
        x[0, 0] = 900.0
        x[-1, -1] = -1e-7
    return x


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def graph_names(out, limit=50):
    names, node = set(), out.grad_fn
    while node is not None and len(names) < limit:
        names.add(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    return names


def one_ulp_apart(ours, theirs):
    """``amax * fp32(1/448)`` vs ``amax / 448``: equal, or adjacent float32 values."""
    gap = (ours.view(torch.int32).long() - theirs.float().view(torch.int32).long()).abs()
    assert gap.max() <= 1 and (gap == 0).any()


def blocks_differing(q, qr, rows_blk, cols_blk):
    d = (q.view(torch.uint8) != qr.view(torch.uint8)).float()
    d = torch.nn.functional.pad(d, (0, cols_blk * 128 - d.shape[1], 0, rows_blk * 128 - d.shape[0]))
    return d.view(rows_blk, 128, cols_blk, 128).sum((1, 3))


def sglang_fp8_utils_reference():
    """SGLang's own block quantizer (``per_block_cast_to_fp8`` + ``ceil_to_ue8m0`` in
    srt/layers/quantization/fp8_utils.py, copied there from DeepGEMM): that module does not import
    on a CPU machine (its CUDA kernel deps), so the two functions' source is read from SGLang's file
    and executed as written."""
    import ast
    import importlib.metadata

    try:
        path = str(importlib.metadata.distribution("sglang").locate_file("sglang/srt/layers/quantization/fp8_utils.py"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed")
    text = open(path).read()
    fns = {n.name: ast.get_source_segment(text, n) for n in ast.parse(text).body
           if isinstance(n, ast.FunctionDef) and n.name in ("per_block_cast_to_fp8", "ceil_to_ue8m0")}
    ns = {"torch": torch, "Tuple": tuple, "ceil_align": lambda x, a: -(-x // a) * a}
    exec(fns["ceil_to_ue8m0"], ns)
    exec(fns["per_block_cast_to_fp8"], ns)
    return ns["per_block_cast_to_fp8"]


def megatron_linears(model):
    from megatron.core.tensor_parallel import layers

    return [m for m in model.modules() if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))]


def ddp_main_grads_fused_vs_unfused(model, state, batches, pos, steps: int = 2) -> tuple[dict, list]:
    """Wrap ``model`` in megatron's DDP (fp32 grad buffers, as the actor does) and run ``steps`` steps of
    backward over ``batches`` (``zero_grad_buffer`` between steps) with precision.fuse_wgrad_accumulation
    off, then on (the FP8 wgrad accumulation and megatron's own fusion for its BF16 linears, here the LM
    head, through ``models/grad_accum.py``). Checks the fusion protocol on the way (flags set exactly when
    fused, one FP8 accumulate call per fused weight and micro-batch, every placeholder gradient dropped by
    megatron's hook) and returns
    ``{(fuse, step): {name: main_grad}}`` and the weights the fused path covers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_jetrl.precision import gemm
    from megatron_jetrl.precision.linear import FP8LinearMixin

    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False))
    fused_weights = [m.weight for m in model.modules() if isinstance(m, FP8LinearMixin) and m.fp8_cache.inv_perm is None]
    calls, real = [], gemm.block_gemm_accumulate

    def counting(*a, **k):
        calls.append(a[4].data_ptr())
        return real(*a, **k)

    from megatron_jetrl.models.grad_accum import enable

    grads = {}
    for fuse in (False, True):
        state.fuse_wgrad_accumulation = fuse
        assert enable(model, fuse) == (sum(1 for _ in megatron_linears(model)) if fuse else 0)
        gemm.block_gemm_accumulate = counting
        try:
            for step in range(steps):
                ddp.zero_grad_buffer()
                calls.clear()
                for tokens in batches:
                    ddp(tokens, pos, None, labels=tokens).float().mean().backward()
                flags = [w.grad_added_to_main_grad for w in fused_weights]
                flags.append(model.output_layer.weight.grad_added_to_main_grad)  # megatron's BF16 LM head
                flags.append(model.embedding.word_embeddings.weight.grad_added_to_main_grad)  # the input embedding
                assert all(flags) if fuse else not any(flags)
                assert len(calls) == (len(batches) * len(fused_weights) if fuse else 0)
                assert all(p.grad is None for p in model.parameters())  # placeholders dropped by the hook
                grads[fuse, step] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        finally:
            gemm.block_gemm_accumulate = real
    return grads, fused_weights


def gpu_input(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * torch.exp(torch.randn(shape[0], 1, device="cuda", generator=g))
    x[0, :5] = 0.0
    if shape[0] > 1:
        x[1, :128] = 0.0
    return x.to(dtype)


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def first_kv_difference(a, b) -> int:
    """The first key at which two FP8 KV caches of one row differ: ``a`` and ``b`` hold the same tensors (K and V
    bytes [layers, groups, keys, d], their scales [layers, groups, keys]), compared byte for byte in every layer, group
    and element; the number of keys where none differs. Outside exact mode the two sides' K/V differ in last bits
    from the second layer on, and the KV rule turns a few such differences into whole E4M3 steps: from that key on,
    every later token attends over different values."""
    keys = a[0].shape[2]
    differ = torch.zeros(keys, dtype=torch.bool)
    for x, y in zip(a, b, strict=True):
        x, y = x.contiguous(), y.contiguous()
        if x.element_size() == 1:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        differ |= (x != y).transpose(0, 2).reshape(keys, -1).any(1)
    return int(differ.nonzero()[0]) if differ.any() else keys


def deepgemm_or_skip():
    from megatron_jetrl.kernels import deepgemm

    ok, why = deepgemm.available(torch.device("cuda"))
    if not ok:
        pytest.skip(f"DeepGEMM not available: {why}")
    return deepgemm


# Prepended to every interpreted program: the interpreter's ``tl.dot`` with a tensor-core MMA's element property, an
# output element's bits a function of its row of the first operand and its column of the second alone, whichever
# operand holds which (each element the products of its k-ordered pairs, summed in k order). The interpreter calls the
# host BLAS's ``matmul`` on the whole tile, whose kernels may round a row by where it sits in the tile (OpenBLAS's
# Haswell/Zen kernels do: a row moved to another place in a 16-row tile changes its last bits); the exact-mode
# kernels' tests compare a decode step's one-query tile with the training forward's many-query tile bit for bit, and
# the key-major decode kernel's transposed products (S^T = K q^T) with the trainer's (S = q K^T).
_INTERPRETER_DOT = """
import numpy as _numpy, types as _types
import triton.runtime.interpreter as _interpreter


def _elementwise_matmul(a, b, dtype=None):
    dt = _numpy.dtype(dtype) if dtype is not None else _numpy.result_type(a, b)
    a, b = a.astype(dt), b.astype(dt)
    out = _numpy.zeros(_numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dt)
    for k in range(a.shape[-1]):  # from +0 (a zero row gives +0, as an MMA's does), the products added in k order:
        out += a[..., :, k:k + 1] * b[..., k:k + 1, :]  # the same for A.B and (B^T.A^T)^T
    return out


class _Numpy(_types.ModuleType):
    def __getattr__(self, name):  # numpy's lazily loaded names
        return getattr(_numpy, name)


assert _interpreter.np is _numpy, "Triton's interpreter no longer calls numpy as np: patch its dot elsewhere"
_np = _Numpy("numpy")
_np.__dict__.update(vars(_numpy), matmul=_elementwise_matmul)
_interpreter.np = _np
"""


def run_interpreted(code: str, *args: str, cwd: str | None = None, each: tuple[tuple[str, ...], ...] = ()) -> None:
    """Run ``code`` in a fresh Python under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before
    Triton is imported, hence a subprocess), its dots element by element in k order (``_INTERPRETER_DOT``), with the arguments
    ``args``, or once per argument tuple of ``each``, those processes at the same time (the interpreter keeps one
    core busy); it passes when every process exits 0 after printing ``ok``."""
    import subprocess
    import sys
    import tempfile

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    if len(each) > 1:  # one thread per process: the processes share the cores
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    runs = []
    for argv in each or (args,):
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: no process waits on a full pipe while another runs
        runs.append((argv, log, subprocess.Popen([sys.executable, "-c", _INTERPRETER_DOT + code, *argv], env=env,
                                                 stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd)))
    try:
        for argv, log, proc in runs:
            rc = proc.wait(timeout=600)
            log.seek(0)
            out = log.read()
            assert rc == 0 and out.strip().endswith("ok"), (argv, out[-3000:])
    finally:
        for _, log, proc in runs:
            proc.kill()
            log.close()
