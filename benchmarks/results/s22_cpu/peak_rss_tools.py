"""Peak RSS of influence (factors + pairwise scores) on the CPU, ours or Kronfluence's, one tool
per fresh process (session 22: EK-FAC's factors released; GPT-2 of 4 layers from its config,
32 training sequences × 256 tokens, 8 queries, batch 8, EK-FAC, Monte-Carlo labels, weight and
bias in one block, damping 1e-3; the setting of ``influence_gpu.py``, scaled down). Run from a
tree: ``PYTHONPATH=<tree> python peak_rss_tools.py {ours,kronfluence}``; prints one JSON line.
The rise is the process's peak RSS during the tool's run above its peak before it (the model,
its copy and the data built)."""

import argparse
import copy
import json
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import influence_gpu as ig

p = argparse.ArgumentParser()
p.add_argument("tool", choices=("ours", "kronfluence"))
p.add_argument("--layers", type=int, default=4)
p.add_argument("--n-train", type=int, default=32)
p.add_argument("--length", type=int, default=256)
p.add_argument("--queries", type=int, default=8)
args = p.parse_args()
a = argparse.Namespace(batch=8, damping=1e-3, fisher="mc", device="cpu", queries=args.queries)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(1)
train = torch.randint(0, 50257, (args.n_train, args.length), generator=g)
query = torch.randint(0, 50257, (args.queries, args.length), generator=g)
model = ig.build_model(args.layers, torch.float32, "cpu")
tracked = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
mine = copy.deepcopy(model)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.time()
run = ig.run_ours if args.tool == "ours" else ig.run_kronfluence
scores = run(mine, tracked, train, query, a)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(
    json.dumps(
        {
            "tool": args.tool,
            "peak_rss_gb": round(after / 2**20, 3),
            "rise_gb": round((after - before) / 2**20, 3),
            "seconds": round(time.time() - start, 1),
            "scores_norm": float(scores.norm()),
            "torch": torch.__version__,
        }
    )
)
