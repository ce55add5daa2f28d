"""Legacy 0.x client: smallest eigenvalues with lanczos(which="SA") from a given start vector.

Written against hessian-eigenthings 0.x; must run unchanged on 1.0 (it warns).
"""

import torch

from hessian_eigenthings.lanczos import lanczos
from hessian_eigenthings.operator import LambdaOperator

torch.manual_seed(0)
n = 80
Q, _ = torch.linalg.qr(torch.randn(n, n))
spectrum = torch.linspace(-2.0, 5.0, n)
A = Q @ torch.diag(spectrum) @ Q.t()

operator = LambdaOperator(lambda vec: A @ vec, n)
init_vec = torch.ones(n)
eigenvals, eigenvecs = lanczos(
    operator, num_eigenthings=3, which="SA", max_steps=100, tol=1e-6, init_vec=init_vec
)
print("eigenvals:", eigenvals.tolist())
print("eigenvecs shape:", eigenvecs.shape)
