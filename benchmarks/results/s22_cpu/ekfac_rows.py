"""EK-FAC's corrected eigenvalues over the diagonal of the exact GGN in KFAC's eigenbasis on a
one-layer GPT-2 of 11 words (session 22, NOTE [columns row by row]): type-2 and 256 Monte-Carlo
draws. Run from the repository root: ``PYTHONPATH=<tree>:. python ekfac_rows.py``."""

import torch

from hessian_eigenthings import GGNOperator, influence
from tests.influence.tiny import tiny_gpt2

torch.manual_seed(0)
model = tiny_gpt2(vocab=11)
g = torch.Generator().manual_seed(0)
train = [{"input_ids": torch.randint(0, 11, (4, 8), generator=g)} for _ in range(3)]
task = influence.causal_lm_task()
for ft, k in (("type2", 1), ("mc", 256)):
    f = influence.fit(
        model, train, task, curvature="ekfac", fisher_type=ft, mc_samples=k, damping=1e-3
    )
    op = f.operator
    names = f.layout.names
    data = [task.operator_batch(b) for b in train]
    ggn = GGNOperator(
        model,
        data,
        task.forward,
        task.loss_of_output,
        param_filter=lambda n, p, s=frozenset(names): n in s,
    )
    assert ggn.layout.names == names, (ggn.layout.names, names)
    Gd = ggn.to_dense()
    eig = op.eigh()
    # diag of GGN in eigenbasis: v^T G v for each eigenvector
    vals, exact = [], []
    for bi, blk in enumerate(eig.blocks):
        m, q = blk.eigenvalues.shape
        for i in range(0, m, max(1, m // 3)):
            for j in range(0, q, max(1, q // 3)):
                v = op.eigenvector(bi, i, j)
                exact.append(float(v @ (Gd @ v)))
                vals.append(float(blk.eigenvalues[i, j]))
    ex, va = torch.tensor(exact), torch.tensor(vals)
    print(
        ft,
        k,
        f"ekfac/exact diag ratio: median {(va / ex).median():.3f} min {(va / ex).min():.3f} max {(va / ex).max():.3f}",
    )
