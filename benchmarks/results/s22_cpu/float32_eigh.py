"""Float32 EK-FAC influence scores against float64 on the CPU (session 22, NOTE [factors decomposed
in float64]): GPT-2 of LAYERS layers from its config (random weights), N training sequences x T tokens,
4 queries, FISHER labels, damping 1e-3; float32 as it is, with float64 eigh of the float32 factors,
with and without the rounding-level cut of EK-FAC's eigenvalues. Run from a tree:
``PYTHONPATH=<tree> python float32_eigh.py 2 16 64 empirical``."""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import influence_gpu as ig
from torch import nn

import hessian_eigenthings.operators.kronecker_eigen as ke

torch.set_num_threads(2)
L, N, T, fisher = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
g = torch.Generator().manual_seed(1)
train = torch.randint(0, 50257, (N, T), generator=g)
query = torch.randint(0, 50257, (4, T), generator=g)
a = argparse.Namespace(batch=8, damping=1e-3, fisher=fisher, device="cpu", queries=4)


def run(dt):
    model = ig.build_model(L, dt, "cpu")
    tracked = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    return ig.run_ours(copy.deepcopy(model), tracked, train, query, a).double()


ref = run(torch.float64)


def rep(name, v):
    print(name, f"rel {float((v - ref).norm() / ref.norm()):.3g}", flush=True)


rep("fp32 as is", run(torch.float32))
orig_zero = ke.at_rounding_level_zeroed
ke.at_rounding_level_zeroed = lambda lam, n, squares=False: lam if squares else orig_zero(lam, n)
rep("fp32 no squares zeroing", run(torch.float32))
ke.at_rounding_level_zeroed = orig_zero
orig_dec = ke.FactorDecompositions._decompose


def dec64(self, M, which, block):
    lam, U = torch.linalg.eigh(M.double())
    return lam.to(M.dtype), U.to(M.dtype)


ke.FactorDecompositions._decompose = dec64
rep("fp32 eigh in fp64", run(torch.float32))
ke.at_rounding_level_zeroed = lambda lam, n, squares=False: lam if squares else orig_zero(lam, n)
rep("fp32 eigh fp64 + no squares zeroing", run(torch.float32))
