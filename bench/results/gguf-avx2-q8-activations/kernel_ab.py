"""The decoder's grouped products alone, two or three builds of the kernel library in one
process, interleaved: 30 SmolLM2-sized layers' worth of distinct 4-bit weights (qkv 960 x 576,
out 576 x 576, gate_up 3072 x 576, down 576 x 1536, Q4_1-like: groups of 32, float16 scales
and offsets), rows 1, 2, 4, 8, medians of 12. The hashes are the kernel cache's builds
(~/.cache/kenspec/kernels/<hash>/libkenspec.so): b4f1... is f275890's, 3cfc... the first
8-bit try, 44de... the same with x spread ahead of the loop. Run from the repository root.
"""
import ctypes, time, torch, statistics, sys
from kenspec.server.engine.quantize import GroupedWeight
torch.set_num_threads(2)
libs = {n: ctypes.CDLL(f"/root/.cache/kenspec/kernels/{h}/libkenspec.so") for n,h in [("old","b4f19683907deb4d"),("new","3cfc46b85106382c"),("wide","44debc47ddeb3dd0")]}
P,L,I=ctypes.c_void_p,ctypes.c_long,ctypes.c_int
for l in libs.values():
    f=l.kenspec_gemv_grouped_avx2; f.restype=I; f.argtypes=[P,P,I,P,P,L,P,L,L,L,I]
def W(out, kin):
    q = torch.randint(0, 16, (out, kin), dtype=torch.int8)
    s = (torch.rand(out, kin//32)*0.01).half().float(); m = ((torch.rand(out, kin//32)-0.5)*0.1).half().float()
    return GroupedWeight.of(q, s, m, 32, 4, half=True)
# 30 layers' worth of distinct weights so they stream from memory
ws = [W(o,i) for _ in range(30) for (o,i) in [(960,576),(576,576),(3072,576),(576,1536)]]
res={}
for rows in (1,2,4,8):
    xs={i: torch.randn(rows, i).bfloat16() for i in (576,1536)}
    ys={o: torch.empty(rows,o,dtype=torch.bfloat16) for o in (960,576,3072)}
    t={n:[] for n in libs}
    for rep in range(12):
        for n,l in libs.items():
            f=l.kenspec_gemv_grouped_avx2
            t0=time.perf_counter()
            for w in ws:
                o,i=w.shape
                f(xs[i].data_ptr(), w.values.data_ptr(), 4, w.scales.data_ptr(), w.mins.data_ptr(), 32, ys[o].data_ptr(), rows, i, o, 1)
            t[n].append(time.perf_counter()-t0)
    res[rows]={n:statistics.median(v)*1e3 for n,v in t.items()}
    print(rows, {n:f"{v:.2f}ms" for n,v in res[rows].items()}, f"new/old {res[rows]['new']/res[rows]['old']:.2f}")
for n in libs: print(n, " ".join(f"{r}:{res[r][n]/res[1][n]:.2f}" for r in res))
