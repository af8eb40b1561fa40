"""Triton kernels compiled for the H200 (sm_90a) on any machine, no GPU needed: Triton's compiler and the
``ptxas``/``nvdisasm`` its wheel ships, the arguments specialized as a launch specializes them (16-divisible pointers
and strides). For each plan the loop that issues the tensor-core instructions is printed: its instruction mix per
iteration, its MMA wait depth (``WARPGROUP.DEPBAR.LE gsb0, N``: N groups left in flight; 0 = each waited for),
the registers and shared memory a program takes and how many programs an SM then holds. A static view of a
kernel change before it is timed (``tools/exact_bench.py``, ``tools/attn_decode_bench.py``).

- ``gemm``: the exact GEMM (``kernels/exact_gemm.py``), plans ``kind:sum_segments:BLOCK_M:BLOCK_N:warps:stages``;
  the fp32 work per group is the promotion's cost.
- ``decode-attn``: the decode attention (``kernels/decode_attn.py``: the head-major kernel over a BF16 cache, the
  key-major one over the decoder's FP8 cache) at the 8B model's shapes (4 query heads per KV group, head dim 128),
  plans ``kv:BLOCK_N:warps:stages[:rows]`` (kv: bf16, fp8 with V [L, d], fp8km with V stored [d, L]:
  the decoder's two layouts, ``rollout.fp8_kv_v_layout``; a ``first`` suffix, ``fp8kmfirst``: valid keys from each
  row's first instead of ``key_ok``'s bytes, the decoder's call; rows: the query tile's, the decoder's by default); also
  warp-instructions per key and per KV byte, the measure of an issue-bound decode kernel.
- ``exact-attn``: exact mode's attention (``kernels/exact_attn.py``, the decoder's and the trainer's) at the same
  shapes, plans ``kv:BLOCK_N:warps:stages:rows`` (rows: query rows per program, 16 the decoder's one position, 32 the
  trainer's eight; kv ``fp8keys``: the key-major decode kernel over the FP8 cache, rows its query heads' columns,
  ``fp8pairs`` the same with two key blocks an iteration, the decoder's plan);
  per key and per KV byte as above, for one program's rows.

The compiler is the Triton this Python imports; the H200 image runs Triton 3.6, whose wheel compiles the same code
on any machine (``PYTHONPATH=<unpacked triton-3.6.0 wheel> python tools/kernel_sass.py ...``).

Usage: python tools/kernel_sass.py gemm [--plans ...] | decode-attn [--plans bf16:64:4:2,fp8:128:4:3,...]
       | exact-attn [--plans fp8:64:4:2:16,...]"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_jetrl.kernels.decode_attn import TAIL_N, _decode_attn_keys_kernel, _decode_attn_kernel
from megatron_jetrl.kernels.exact_attn import _exact_attn_kernel, _exact_decode_keys_kernel
from megatron_jetrl.kernels.exact_gemm import BF16_GROUP, _exact_gemm_kernel

PLANS = "fp8:1:64:128:4:4,fp8:0:64:128:4:4,fp8:1:64:256:4:3,bf16:1:128:128:8:3,bf16:0:64:128:4:4"
ATTN_PLANS = "bf16:64:4:2,fp8:128:4:2,fp8km:128:4:2,fp8:128:4:3,fp8:64:4:2,fp8:256:4:2"
EXACT_ATTN_PLANS = "bf16:64:4:2:16,fp8:64:4:2:16,fp8pairs:64:2:2:8,fp8keys:64:2:3:8,bf16:64:4:2:32,fp8:64:4:2:32"
SM90_TARGET = GPUTarget("cuda", 90, 32)
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def compile_gemm(fp8: bool, sum_segs: bool, block_m: int, block_n: int, warps: int, stages: int):
    """The kernel with TMA descriptors for sm_90a; returns Triton's compiled kernel (``asm["cubin"]``)."""
    G = 128 if fp8 else BF16_GROUP
    dt = "fp8e4nv" if fp8 else "bf16"
    types = {"a_ptr": f"tensordesc<{dt}[{block_m},{G}]>", "as_ptr": "*fp32", "b_ptr": f"tensordesc<{dt}[{block_n},{G}]>",
             "bs_ptr": "*fp32", "y_ptr": "*bf16" if sum_segs else "*fp32"}  # every other argument: an i32
    consts = {"G": G, "BLOCK_M": block_m, "BLOCK_N": block_n, "SUM_SEGS": sum_segs, "FP8": fp8, "IEEE": False,
              "TMA": True}
    return _compile_by_name(_exact_gemm_kernel, types, consts, num_warps=warps, num_stages=stages)


def _compile_by_name(kernel, types: dict, consts: dict, **options):
    """``kernel`` for sm_90a with the argument types ``types`` and the constexprs ``consts`` given by name (every
    other argument an i32, 16-divisible as a launch specializes it unless the kernel does not specialize on it)."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    fixed = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    return triton.compile(ASTSource(kernel, sig, consts, _divisible(sig, fixed)), target=SM90_TARGET, options=options)


def _attn_types(kv: str) -> dict:
    """The pointer and float arguments the attention kernels share: BF16 q and output, the cache in ``kv``'s dtype,
    fp32 FP8 scales."""
    cache = "*fp8e4nv" if kv == "fp8" else "*bf16"
    return {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "ks_ptr": "*fp32", "vs_ptr": "*fp32",
            "qk_scale": "fp32"}


def compile_decode_attn(kv: str, block_n: int, warps: int, stages: int, splits: int = 2, block_h: int | None = None,
                        v_key_major: bool = False, first: bool = False):
    """The decode attention for sm_90a: 4 query heads per KV group, head dim 128; ``kv`` bf16 (the head-major
    kernel over a [L, d] cache) or fp8 (the key-major kernel over the FP8 cache; V stored [L, d], or with
    ``v_key_major`` [d, L]); ``block_h``: the query tile's rows instead of the decoder's (8
    key-major, 16 head-major); ``first``: valid keys from each row's first (``first_key``, the decoder's call) instead of
    ``key_ok``'s bytes."""
    fp8 = kv == "fp8"
    types = {**_attn_types(kv), "ok_ptr": "*u8", "first_ptr": "*i64", "pos_ptr": "*i64", "part_ptr": "*fp32",
             "ml_ptr": "*fp32", "scale": "fp32"}
    consts = {"HPG": 4, "D": 128, "BLOCK_H": block_h or (8 if fp8 else 16), "BLOCK_D": 128, "BLOCK_N": block_n,
              "SPLIT": splits, "NUM_STAGES": stages, "IEEE": False}
    if fp8:  # V's unit stride (Triton specializes a 1 as a constant): its features ([L, d]) or its keys ([d, L])
        consts.update(TAIL_N=TAIL_N, V_KEYS=v_key_major, LOAD16=True, KV_FP8=True, F16=True, FIRST=first,
                      **{"sv_l" if v_key_major else "sv_d": 1})
    return _compile_by_name(_decode_attn_keys_kernel if fp8 else _decode_attn_kernel, types, consts, num_warps=warps)


def compile_exact_attn(kv: str, block_n: int, warps: int, stages: int, rows: int, pairs: bool = False):
    """Exact mode's attention for sm_90a: 4 query heads per KV group, head dim 128, ``rows`` query rows per program;
    ``kv`` bf16 or fp8 (the cache's bytes converted to fp16 in registers, its scales on scores and weights, V
    key-major; ``pairs``: the key-major decode kernel's two key blocks an iteration)."""
    if kv == "fp8keys":  # the key-major decode kernel over the FP8 cache (rows: its query heads' columns), writing the
        # output projection's FP8 input as the decoder's call does
        consts = {"HPG": 4, "BLOCK_H": rows, "D": 128, "BLOCK_D": 128, "BLOCK_N": block_n, "F16": True, "IEEE": False,
                  "WIDE": False, "QUANT": True, "UE8M0": False, "PAIRS": pairs}
        types = {**_attn_types("fp8"), "q0_ptr": "*i64", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "inv_max": "fp32",
                 "fmax": "fp32", "eps": "fp32"}
        return _compile_by_name(_exact_decode_keys_kernel, types, consts, num_warps=warps, num_stages=stages)
    types = {**_attn_types(kv), "q0_ptr": "*i64"}
    consts = {"HPG": 4, "R": rows, "D": 128, "BLOCK_D": 128, "BLOCK_N": block_n, "KV_FP8": kv == "fp8",
              "F16": kv == "fp8", "IEEE": False, "WIDE": False}
    # V's unit stride (Triton specializes a 1 as a constant): the FP8 cache keeps V key-major ([d, L]), BF16 [L, d]
    consts["sv_l" if kv == "fp8" else "sv_d"] = 1
    return _compile_by_name(_exact_attn_kernel, types, consts, num_warps=warps, num_stages=stages)


def _divisible(sig: dict, fixed: set = frozenset()) -> dict:
    """Pointers and integer arguments 16-divisible, as Triton specializes them at a launch with such values, except
    the kernel's ``do_not_specialize`` ones (``fixed``), which a launch never specializes: a mask against such a
    length is not known to be constant over a vector, and loads along it go element by element."""
    return {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
            if (t.startswith("*") or t == "i32") and n not in fixed}


def mma_loop(sass: str) -> list[str]:
    """The SASS lines of the main loop: of the loops (from the label a conditional backward branch returns to, up
    to that branch; the unconditional jumps back from out-of-line barrier waits do not close a loop) the one with
    the most tensor-core instructions per iteration, the innermost of those (a kernel's narrow tail loop or an
    outer loop around the pipelined one is not it)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := _LABEL.match(ln.strip()))}
    best, key = [], None
    for j, ln in enumerate(lines):
        m = re.search(r"@!?P\w+\s+BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), j) < j:
            body = lines[labels[m.group(1)]:j + 1]
            mmas = sum("MMA" in b for b in body)
            if mmas and (key is None or (-mmas, len(body)) < key):
                best, key = body, (-mmas, len(body))
    return best


def main_loop(kernel) -> list[str]:
    """A compiled kernel -> the SASS lines of its main loop (:func:`mma_loop`)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return mma_loop(subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout)


def loop_mix(kernel) -> tuple[collections.Counter, list[str]]:
    """A compiled kernel -> (its MMA loop's opcode counts per iteration, the loop's wait depths)."""
    loop = main_loop(kernel)
    mix = collections.Counter(m.group(1) for ln in loop if (m := _INSN.search(ln)))
    return mix, sorted(set(re.findall(r"DEPBAR\.LE gsb0, (0x\d+)", "\n".join(loop))))


def registers(kernel) -> int:
    """Registers per thread of a compiled kernel (``cuobjdump -res-usage``)."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    """Resident programs per H100/H200 SM: 64K registers (allocated per warp in 256s), 227 KiB of shared memory
    (1 KiB reserved per program)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 232448 // (shared + 1024), 32)


def gemm_plan(plan: str) -> tuple[collections.Counter, list[str], int]:
    """``kind:sum_segments:BLOCK_M:BLOCK_N:warps:stages`` -> (loop mix, wait depths, shared bytes)."""
    kind, ss, *nums = plan.split(":")
    k = compile_gemm(kind == "fp8", ss == "1", *map(int, nums))
    return (*loop_mix(k), k.metadata.shared)


def decode_attn_plan(plan: str, exact: bool = False) -> dict:
    """``kv:BLOCK_N:warps:stages[:rows]`` (rows: the query tile's; ``exact``: exact mode's kernel) -> the main loop
    (``loop``: its SASS lines, ``mix``: opcode counts per iteration), ``regs``, ``shared`` bytes, ``programs`` per SM,
    warp-instructions ``per_key`` and ``per_byte`` of K and V (with the FP8 cache's scales)."""
    kv, block_n, warps, stages, *rows = plan.split(":")
    first, kv = kv.endswith("first"), kv.removesuffix("first")
    v_key_major, kv = kv == "fp8km", "fp8" if kv == "fp8km" else kv
    pairs, kv = kv == "fp8pairs", "fp8keys" if kv == "fp8pairs" else kv
    if exact:
        k = compile_exact_attn(kv, int(block_n), int(warps), int(stages), int(rows[0]), pairs)
    else:
        k = compile_decode_attn(kv, int(block_n), int(warps), int(stages), block_h=int(rows[0]) if rows else None,
                                v_key_major=v_key_major, first=first)
    loop = main_loop(k)
    mix = collections.Counter(m.group(1) for ln in loop if (m := _INSN.search(ln)))
    per_key = sum(mix.values()) * int(warps) / (int(block_n) * (2 if pairs else 1))
    fp8 = kv.startswith("fp8")
    key_bytes = 2 * 128 * (1 if fp8 else 2) + (8 if fp8 else 0)  # K + V (+ their scales)
    regs = registers(k)
    return {"loop": loop, "mix": mix, "regs": regs, "shared": k.metadata.shared,
            "programs": programs_per_sm(regs, int(warps), k.metadata.shared), "per_key": per_key,
            "per_byte": per_key / key_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=["gemm", "decode-attn", "exact-attn"])
    ap.add_argument("--plans")
    a = ap.parse_args()
    default = {"gemm": PLANS, "decode-attn": ATTN_PLANS, "exact-attn": EXACT_ATTN_PLANS}[a.kernel]
    for plan in (a.plans or default).split(","):
        if a.kernel == "gemm":
            kind, ss, block_m, block_n, warps, stages = plan.split(":")
            k = compile_gemm(kind == "fp8", ss == "1", int(block_m), int(block_n), int(warps), int(stages))
            (mix, waits), regs, shared = loop_mix(k), registers(k), k.metadata.shared
            head = f"{regs} registers, shared {shared} B, {programs_per_sm(regs, int(warps), shared)} programs/SM"
            extra = ""
        else:
            r = decode_attn_plan(plan, a.kernel == "exact-attn")
            mix, waits = r["mix"], []
            head = f"{r['regs']} registers, shared {r['shared']} B, {r['programs']} programs/SM"
            extra = f"; {r['per_key']:.1f} warp-instructions per key, {r['per_byte']:.3f} per KV byte"
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(10))
        mmas = " + ".join(f"{mix[op]} {op}" for op in sorted(mix) if op.endswith("MMA"))  # warp-level / warpgroup
        print(f"{plan}: {head}; MMA loop {sum(mix.values())} instructions/iteration ({mmas}; "
              f"wait depth {'/'.join(waits) or '-'}){extra}: {top}", flush=True)


if __name__ == "__main__":
    main()
