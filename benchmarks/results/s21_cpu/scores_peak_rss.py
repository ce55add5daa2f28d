"""Peak RSS of ``pairwise_scores`` on the CPU (session 21, the layer-by-layer scores): GPT-2 of 4
layers from its config, 2 training batches of 8 × 256 tokens, 8 queries, EK-FAC. Run from a
tree (``PYTHONPATH=<tree> python scores_peak_rss.py``); prints one JSON line."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import influence_gpu as ig

from hessian_eigenthings import influence

torch.set_num_threads(1)
torch.manual_seed(0)
model = ig.build_model(4, torch.float32, "cpu")
tracked = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
g = torch.Generator().manual_seed(1)
train = torch.randint(0, 50257, (16, 256), generator=g)
query = torch.randint(0, 50257, (8, 256), generator=g)
batches = [{"input_ids": train[i : i + 8]} for i in range(0, 16, 8)]
fitted = influence.fit(
    model,
    batches,
    influence.causal_lm_task(),
    damping=1e-3,
    fisher_type="mc",
    separate_bias=False,
    param_filter=lambda n, p: n.rsplit(".", 1)[0] in tracked,
)
Q = fitted.query_gradients([{"input_ids": query}])  # the process's peak before the scores
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.time()
scores = fitted.pairwise_scores([{"input_ids": query}], batches, progress=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(
    json.dumps(
        {
            "peak_rss_gb": after / 2**20,
            "peak_rss_before_scores_gb": before / 2**20,
            "n": fitted.layout.size,
            "seconds": round(time.time() - start, 1),
            "norm": float(scores.norm()),
        }
    )
)
