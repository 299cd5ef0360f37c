import time, sys, random
from pagedserve import LLM, SamplingParams
llm = LLM(max_model_len=2048)
tok = None
random.seed(0)
prompts = [[random.randrange(100, 40000) for _ in range(200)] for _ in range(16)]
long = [[random.randrange(100, 40000) for _ in range(1500)]]
sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)  # warm
t=time.time(); llm.generate([{"prompt_token_ids": p} for p in long], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False); pre=time.time()-t
t=time.time(); outs=llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False); w=time.time()-t
t=time.time(); llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False); s=time.time()-t
print(f"RESULT {sys.argv[1]} prefill1500={pre:.2f}s batch16x(200+32)={w:.2f}s single(200+64)={s:.2f}s")
