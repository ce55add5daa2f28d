"""Legacy 0.x client: use_gpu=True everywhere, as 0.x examples did, on a machine without CUDA.

0.x crashed here; 1.0 warns once per call site and runs on the CPU.
Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch
import torch.nn as nn

from hessian_eigenthings import HVPOperator, deflated_power_iteration, lanczos

torch.manual_seed(0)
dataloader = [(torch.randn(20, 4), torch.randint(0, 2, (20,))) for _ in range(2)]
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
criterion = nn.CrossEntropyLoss()

op = HVPOperator(model, dataloader, criterion, use_gpu=True, max_possible_gpu_samples=8)
eigenvals, eigenvecs = deflated_power_iteration(op, 2, 100, 1e-6, 0.0, True)
lanczos_vals, lanczos_vecs = lanczos(op, 2, use_gpu=True)
print("eigenvals:", eigenvals.tolist())
print("lanczos eigenvals:", lanczos_vals.tolist())
