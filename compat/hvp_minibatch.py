"""Legacy 0.x client: HVPOperator on one batch at a time (full_dataset=False), used directly.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch
import torch.nn as nn

from hessian_eigenthings.hvp_operator import HVPOperator
from hessian_eigenthings.power_iter import power_iteration
from hessian_eigenthings.utils import format_time, log, progress_bar

torch.manual_seed(0)
batches = [(torch.randn(16, 6), torch.randn(16, 1)) for _ in range(3)]
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
criterion = nn.MSELoss()

op = HVPOperator(model, batches, criterion, use_gpu=False, full_dataset=False)
vec = torch.randn(op.size)
products = []
for i in range(len(batches)):
    products.append(op.apply(vec))
    progress_bar(i, len(batches), "hvp")
op._zero_grad()  # the name 0.x's HVPOperator had
log("size %d, %d products in %s" % (op.size, len(products), format_time(1.5)))  # noqa: UP031 (0.x style)

full_op = HVPOperator(model, batches, criterion, use_gpu=False, full_dataset=True)
eigenval, eigenvec = power_iteration(full_op, steps=200, error_threshold=1e-6, use_gpu=False)
print("eigenval:", eigenval)
print("product norms:", [float(p.norm()) for p in products])
