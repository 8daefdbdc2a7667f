import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
L = 30
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
W = [torch.randn(o, i).bfloat16() * 0.02 for _ in range(L) for (o, i) in shapes]
nbytes = sum(w.numel() * 2 for w in W)
print("weights MB", nbytes / 1e6)


def bench(fn, reps=9):
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


modes = sys.argv[1].split(",")
Ms = [int(m) for m in sys.argv[2].split(",")]
prep = {}
if "mkldnn" in modes:
    prep["mkldnn"] = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in W]
if "mkldnn7" in modes:
    prep["mkldnn7"] = [torch.ops.mkldnn._reorder_linear_weight(w, 7) for w in W]
if "int8" in modes:
    q = []
    for w in W:
        s = w.float().abs().amax(1) / 127
        q.append((torch.round(w.float() / s[:, None]).to(torch.int8), s.bfloat16()))
    prep["int8"] = q
if "int4" in modes:
    q = []
    g = 32
    for w in W:
        o, i = w.shape
        wg = w.float().reshape(o, i // g, g)
        mn = wg.amin(-1, keepdim=True)
        mx = wg.amax(-1, keepdim=True)
        s = (mx - mn).clamp(min=1e-6) / 15
        qq = torch.clamp(torch.round((wg - mn) / s), 0, 15).to(torch.int32).reshape(o, i)
        z = mn + 8 * s
        sz = (
            torch.stack([s.reshape(o, i // g), z.reshape(o, i // g)], -1)
            .transpose(0, 1)
            .contiguous()
            .bfloat16()
        )
        q.append((torch._convert_weight_to_int4pack_for_cpu(qq, 2), sz))
    prep["int4"] = q
if "fp32" in modes or "mkl" in modes:
    Wf = [w.float() for w in W]
if "mkl" in modes:
    prep["mkl"] = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in Wf]
for M in Ms:
    res = {}
    for mode in modes:
        if mode == "bf16":
            xs = {i: torch.randn(M, i).bfloat16() for i in (576, 1536)}

            def f():
                return [F.linear(xs[w.shape[1]], w) for w in W]
        elif mode in ("mkldnn", "mkldnn7"):
            xs = {i: torch.randn(M, i).bfloat16() for i in (576, 1536)}

            def f():
                return [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(W, prep[mode], strict=False)
                ]
        elif mode == "int8":
            xs = {i: torch.randn(M, i).bfloat16() for i in (576, 1536)}

            def f():
                return [
                    torch._weight_int8pack_mm(xs[w.shape[1]], q, s)
                    for w, (q, s) in zip(W, prep["int8"], strict=False)
                ]
        elif mode == "int4":
            xs = {i: torch.randn(M, i).bfloat16() for i in (576, 1536)}

            def f():
                return [
                    torch._weight_int4pack_mm_for_cpu(xs[w.shape[1]], q, 32, s)
                    for w, (q, s) in zip(W, prep["int4"], strict=False)
                ]
        elif mode == "fp32":
            xs = {i: torch.randn(M, i) for i in (576, 1536)}

            def f():
                return [F.linear(xs[w.shape[1]], w) for w in Wf]
        elif mode == "mkl":
            xs = {i: torch.randn(M, i) for i in (576, 1536)}

            def f():
                return [
                    torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, 1)
                    for (p, w) in prep["mkl"]
                ]

        mn, md = bench(f)
        res[mode] = f"{mn * 1e3:.1f}/{md * 1e3:.1f}ms"
    print("M", M, res, flush=True)
