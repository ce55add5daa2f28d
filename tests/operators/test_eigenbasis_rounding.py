"""EKFAC's corrected eigenvalues at the rounding level (NOTE [eigenvalues at the rounding level]):
means of squared projections are zero only below ``(n·eps)²`` of the largest, so a float32 damped
inverse keeps the small real ones. Repro: a one-layer GPT-2, 8 sequences of 16 tokens, empirical
EKFAC, damping 1e-3; zeroing below ``n·eps`` made the float32 influence scores 25% off the float64
ones (measured; GPT-2 124M's 16× off), against 0.4% now."""

from __future__ import annotations

import copy

import pytest
import torch

from hessian_eigenthings import influence
from hessian_eigenthings.operators.kronecker_eigen import at_rounding_level_zeroed


def test_float32_ekfac_scores_match_float64() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=128,
        n_head=2,
        vocab_size=1000,
        n_positions=16,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, 1000, (8, 16), generator=g)}]
    query = [{"input_ids": torch.randint(0, 1000, (2, 16), generator=g)}]
    scores = {}
    for dtype in (torch.float64, torch.float32):
        fitted = influence.fit(
            copy.deepcopy(model).to(dtype),
            train,
            influence.causal_lm_task(),
            damping=1e-3,
            fisher_type="empirical",
            separate_bias=False,
        )
        scores[dtype] = fitted.pairwise_scores(query, train, progress=False).double()
    error = (scores[torch.float32] - scores[torch.float64]).norm() / scores[torch.float64].norm()
    assert error < 0.02, f"float32 EKFAC scores {float(error):.3g} off float64"


def test_squares_zeroed_below_the_squared_tolerance_and_small_negatives() -> None:
    eps = torch.finfo(torch.float32).eps
    n = 100
    lam = torch.tensor([1.0, 1e-4, (n * eps) ** 2 / 2, -(n * eps) / 2, -1.0], dtype=torch.float32)
    squares = at_rounding_level_zeroed(lam, n, squares=True)
    torch.testing.assert_close(squares, torch.tensor([1.0, 1e-4, 0.0, 0.0, -1.0]))
    plain = at_rounding_level_zeroed(lam, n)
    torch.testing.assert_close(
        plain, torch.tensor([1.0, 1e-4, 0.0, 0.0, -1.0]) * (lam.abs() > n * eps)
    )
