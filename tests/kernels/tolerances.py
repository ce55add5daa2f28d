"""The one tolerance table of the kernel tests.

Every implementation is compared with the float64 reference evaluated on the
same (already rounded) inputs, so the tolerances measure the implementation's
arithmetic and its output rounding only. ``atol`` is relative to the largest
reference entry (outputs scale like ``1/n``).
"""

from __future__ import annotations

import torch

#: dtype -> (rtol, atol as a fraction of max |reference|)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_matches(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (any dtype) against a float64 ``expected64`` at ``dtype``'s tolerance."""
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    torch.testing.assert_close(
        actual.double(), expected64, rtol=rtol, atol=atol * scale + 1e-30, equal_nan=False
    )
