"""Influence scores of ours and Kronfluence's by Fisher type on the CPU, float64 (session 22):
GPT-2 of two layers, vocabulary V, T tokens, N training sequences, width W, damping 1e-3. Needs
Kronfluence importable (``pip install --no-deps --target DIR kronfluence==1.0.1 einconv
deprecation accelerate``; ``PYTHONPATH=DIR:<tree>``). ``python mc_draws.py V T N W``."""

import argparse
import copy
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import influence_gpu as ig
from torch import nn

from hessian_eigenthings import influence

torch.manual_seed(0)
V, T, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = transformers.GPT2Config(
    vocab_size=V,
    n_positions=T,
    n_embd=int(sys.argv[4]),
    n_layer=2,
    n_head=2,
    attn_implementation="eager",
)
model = ig.conv1d_as_linear(transformers.GPT2LMHeadModel(cfg)).double().eval()
tracked = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
g = torch.Generator().manual_seed(1)
train = torch.randint(0, V, (N, T), generator=g)
query = torch.randint(0, V, (4, T), generator=g)
a = argparse.Namespace(batch=8, damping=1e-3, fisher="mc", device="cpu", queries=4)
res = {}
chosen = set(tracked)
tb = [{"input_ids": train[i : i + 8]} for i in range(0, N, 8)]
for ft, k in (("mc", 1), ("mc", 8), ("empirical", 1)):
    f = influence.fit(
        copy.deepcopy(model),
        tb,
        influence.causal_lm_task(),
        damping=1e-3,
        fisher_type=ft,
        mc_samples=k,
        separate_bias=False,
        param_filter=lambda n, p: n.rsplit(".", 1)[0] in chosen,
    )
    res[f"ours {ft}{k}"] = f.pairwise_scores([{"input_ids": query}], tb, progress=False).double()
res["kf mc"] = ig.run_kronfluence(copy.deepcopy(model), tracked, train, query, a).double()
a.fisher = "empirical"
res["kf empirical"] = ig.run_kronfluence(copy.deepcopy(model), tracked, train, query, a).double()
ref = res["ours empirical1"]
for k, v in res.items():
    print(
        k,
        f"norm {float(v.norm()):.4g} rel-to-type2 {float((v - ref).norm() / ref.norm()):.3g} spearman {ig.spearman(v.flatten(), ref.flatten()):.3f}",
    )
