"""Legacy 0.x client: a fixed number of power-iteration steps (negative threshold),
to_numpy=False, one batch per product (full_dataset=False), results used as numpy arrays.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import numpy as np
import torch
import torch.nn as nn

from hessian_eigenthings import HVPOperator, deflated_power_iteration

torch.manual_seed(0)
batch = (torch.randn(64, 6), torch.randint(0, 2, (64,)))
dataloader = [batch]  # one batch, cycled: full_dataset=False is exact here
model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2))
criterion = nn.CrossEntropyLoss()

op = HVPOperator(model, dataloader, criterion, use_gpu=False, full_dataset=False)
eigs, vecs = deflated_power_iteration(
    op,
    num_eigenthings=2,
    power_iter_steps=60,
    power_iter_err_threshold=-1.0,
    use_gpu=False,
    to_numpy=False,
)
eigs_copy = eigs.copy()
ratio = eigs_copy[0] / eigs_copy[1]
norms = np.linalg.norm(vecs, axis=1)
print("eigenvalues:", eigs_copy.tolist())
print("ratio:", float(ratio))
print("norms:", norms.tolist())
