import torch, time, statistics
torch.set_num_threads(1)
from server.engine import cpu_gemv
g = cpu_gemv.load()
torch.manual_seed(0)
shapes=[(1728,576),(576,576),(3072,576),(576,1536)]*30
ws=[torch.randn(o,k).bfloat16() for o,k in shapes]
packs=[torch.ops.mkldnn._reorder_linear_weight(w,1) for w in ws]
def run(rows, kind):
    xs={k: torch.randn(rows,k).bfloat16() for k in (576,1536)}
    t=time.perf_counter()
    for w,p in zip(ws,packs):
        x=xs[w.shape[1]]
        if kind=="gemv": g(x,w)
        else: torch.ops.mkldnn._linear_pointwise(x,p,None,"none",[],"")
    return time.perf_counter()-t
for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 34, 64, 136, 512):
    r={k: statistics.median([run(rows,k) for _ in range(7)])*1e3 for k in ("gemv","packed")}
    print(rows, {k: round(v,2) for k,v in r.items()})
