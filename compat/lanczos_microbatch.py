"""Legacy 0.x client: mode="lanczos" with max_steps, batches larger than
max_possible_gpu_samples (split into chunks), results consumed as numpy.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from hessian_eigenthings import compute_hessian_eigenthings

torch.manual_seed(0)
X = torch.randn(192, 10)
y = torch.randint(0, 3, (192,))
dataloader = DataLoader(TensorDataset(X, y), batch_size=96)

model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
criterion = nn.CrossEntropyLoss()

eigenvals, eigenvecs = compute_hessian_eigenthings(
    model,
    dataloader,
    criterion,
    num_eigenthings=5,
    mode="lanczos",
    use_gpu=False,
    max_possible_gpu_samples=32,
    max_steps=100,
)
top = eigenvals[np.argsort(-np.abs(eigenvals))]
overlap = eigenvecs @ eigenvecs.T
np.save("/dev/null", eigenvecs)
print("eigenvals (ARPACK order):", eigenvals.tolist())
print("largest |lambda|:", float(top[0]))
print("orthonormal:", bool(np.allclose(overlap, np.eye(5), atol=1e-3)))
