"""Legacy 0.x client: compute_hessian_eigenthings with fp16=True vectors.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch
import torch.nn as nn

from hessian_eigenthings import compute_hessian_eigenthings

torch.manual_seed(0)
dataloader = [(torch.randn(32, 5), torch.randint(0, 3, (32,))) for _ in range(2)]
model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
criterion = nn.CrossEntropyLoss()

eigenvals, eigenvecs = compute_hessian_eigenthings(
    model,
    dataloader,
    criterion,
    num_eigenthings=2,
    use_gpu=False,
    fp16=True,
    power_iter_steps=100,
    power_iter_err_threshold=1e-3,
)
print("eigenvals:", eigenvals.tolist())
print("eigenvecs dtype:", eigenvecs.dtype)
