"""Legacy 0.x client: top Hessian eigenpairs of a small MLP classifier by power iteration.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from hessian_eigenthings import compute_hessian_eigenthings

torch.manual_seed(0)
X = torch.randn(128, 8)
y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()
dataloader = DataLoader(TensorDataset(X, y), batch_size=64)

model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 2))
criterion = torch.nn.CrossEntropyLoss()

num_eigenthings = 3
eigenvals, eigenvecs = compute_hessian_eigenthings(
    model,
    dataloader,
    criterion,
    num_eigenthings,
    power_iter_steps=100,
    power_iter_err_threshold=1e-6,
)
print("eigenvals:", eigenvals.tolist())
print("eigenvecs shape:", eigenvecs.shape)
