import json, sys
sys.argv=[sys.argv[0]]
from bench.perplexity import load, score, TEXTS
M='/work/main/.cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf'
lines=[l for t in TEXTS for l in t.read_text().splitlines() if l.strip()]
out={}
for mode in ("fp32","gguf"):
    t=load(M,mode); ids_all=[]; top=[]
    for line in lines:
        ids=t.encode_prompt(line)
        if len(ids)<2: continue
        ids_all.append(ids); top.append(score(t,ids)[1])
    out[mode]=top; out["ids"]=ids_all
json.dump(out, open(sys_out:='/tmp/top1_'+__import__('os').environ['TAG']+'.json','w'))
