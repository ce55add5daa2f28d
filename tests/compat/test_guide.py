"""Every ```python block of migration_guide.md runs, in order, in one namespace.

Blocks whose first line is ``# 0.x`` must warn with DeprecatedWarning; blocks
marked ``# 1.0`` must emit no deprecation warning (the 1.0 path never does; a
solver may still report a ConvergenceWarning); ``# warnings`` blocks show
filters and are only run.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import deprecation
import pytest

from hessian_eigenthings.algorithms import ConvergenceWarning

GUIDE = Path(__file__).resolve().parents[2] / "migration_guide.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[str]:
    return BLOCK.findall(GUIDE.read_text())


def test_every_block_is_labelled() -> None:
    blocks = _blocks()
    assert len(blocks) >= 10
    for block in blocks:
        assert re.match(r"# (0\.x|1\.0|warnings)\b", block), block.splitlines()[0]


def test_guide_blocks_run(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "migration_guide"}
    for i, block in enumerate(_blocks()):
        label = block.split()[1]
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            exec(compile(block, f"{GUIDE}:block{i}", "exec"), namespace)
        categories = [r.category for r in rec]
        if label == "0.x":
            assert deprecation.DeprecatedWarning in categories, (i, block)
        elif label == "1.0":
            assert all(r.category is ConvergenceWarning for r in rec), (
                i,
                [str(r.message) for r in rec],
            )
