import json, numpy as np
from llama_cpp import Llama
d=json.load(open('/tmp/top1_new.json'))
llm=Llama(model_path='/work/main/.cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf', n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
tops=[]
for ids in d["ids"]:
    llm.reset(); llm.eval(ids)
    tops.append(np.asarray(llm.scores[:len(ids)-1]).argmax(-1).tolist())
json.dump(tops, open('/tmp/d71/top1_llama.json','w'))
