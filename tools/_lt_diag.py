# device diagnostic: which cuBLASLt configuration the heuristic accepts (tried only if the tests fail)
import ctypes, torch
from megatron_jetrl.precision import cublaslt as L
from megatron_jetrl.precision.quant import quantize_act, quantize_transposed
from megatron_jetrl.precision.recipe import FP8Recipe
lt, why = L._lt(); print("lt", lt, why, lt and lt.version)
r = FP8Recipe(); T, N, K = 512, 768, 1024
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16); dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
xq, xs = quantize_act(x, r); a, a_s = quantize_transposed(dy, r, False); b, b_s = quantize_transposed(xq, r, True, x_scale=xs)
a_s = a_s.t().contiguous().t(); b_s = b_s.contiguous()
for out_type, c_type, modes in [(0, 0, (5, 4)), (14, 14, (5, 4)), (0, 0, (4, 5)), (0, 0, (4, 4)), (14, 14, (4, 4))]:
    desc = ctypes.c_void_p(); lt.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, 0)
    for attr, v in ((3, ctypes.c_int32(1)), (4, ctypes.c_int32(0)), (31, ctypes.c_int32(modes[0])), (32, ctypes.c_int32(modes[1])),
                    (17, ctypes.c_void_p(b_s.data_ptr())), (18, ctypes.c_void_p(a_s.data_ptr()))):
        st = lt.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v))
        if st: print("set", attr, st)
    A = lt._layout(28, K, N, K) if False else lt._layout(28, T, K, T); B = lt._layout(28, T, N, T)
    C = lt._layout(c_type, K, N, K); D = lt._layout(out_type, K, N, K)
    pref = ctypes.c_void_p(); lt.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
    ws = ctypes.c_uint64(32 << 20); lt.lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), 8)
    res, n = L._Heuristic(), ctypes.c_int32(0)
    st = lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle(0), desc, A, B, C, D, pref, 1, ctypes.byref(res), ctypes.byref(n))
    print("out", out_type, "C", c_type, "modes", modes, "status", st, "n", n.value, flush=True)
