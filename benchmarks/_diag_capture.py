import sys, traceback, torch
from benchmarks.workloads import gpt2
w = gpt2("cuda")
ids = w.batch["input_ids"]
for use_cache in (sys.argv[1] == '1',):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.model(input_ids=ids, use_cache=use_cache)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            out = w.model(input_ids=ids, use_cache=use_cache).logits
        print("use_cache", use_cache, "captured forward")
    except Exception:
        print("use_cache", use_cache, "FAILED")
        traceback.print_exc(limit=-6)
