"""Legacy 0.x client: a hand-written Operator subclass and deflated power iteration.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch

from hessian_eigenthings.operator import Operator
from hessian_eigenthings.power_iter import deflated_power_iteration


class LowRankPlusDiagonal(Operator):
    """A = U diag(s) U^T + d I, applied without forming A."""

    def __init__(self, U, s, d):
        size = U.shape[0]
        super().__init__(size)
        self.U = U
        self.s = s
        self.d = d

    def apply(self, vec):
        return self.U @ (self.s * (self.U.t() @ vec)) + self.d * vec


torch.manual_seed(0)
n = 60
U, _ = torch.linalg.qr(torch.randn(n, 4))
s = torch.tensor([10.0, 6.0, 3.0, 1.5])
operator = LowRankPlusDiagonal(U, s, 0.1)

eigenvals, eigenvecs = deflated_power_iteration(
    operator, num_eigenthings=3, power_iter_steps=200, power_iter_err_threshold=1e-7, use_gpu=False
)
print("eigenvals:", eigenvals.tolist())
print("expected:", (s[:3] + 0.1).tolist())
