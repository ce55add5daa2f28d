"""The real-0.x benchmark column's mechanics: one worker process per implementation, each
importing only its own package (0.x shares our import name), results and crashes reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import real0x


def _fake_0x(tmp_path: Path) -> Path:
    # not 0.x: a package of the same name that fails like a missing dependency would
    pkg = tmp_path / "checkout" / "hessian_eigenthings"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "def compute_hessian_eigenthings(*a, **k):\n    raise RuntimeError('fake 0.x')\n"
    )
    return pkg.parent


def test_each_worker_imports_its_own_package_and_crashes_are_reported(tmp_path: Path) -> None:
    checkout = _fake_0x(tmp_path)
    out = tmp_path / "out"
    real0x.main(
        [
            "--real-0x",
            str(checkout),
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--only",
            "lanczos_microbatch",
            "--out",
            str(out),
        ]
    )
    doc = json.loads((out / "real0x.json").read_text())
    (row,) = doc["rows"]
    assert (
        Path(row["packages"]["0x"]).resolve()
        == (checkout / "hessian_eigenthings" / "__init__.py").resolve()
    )
    assert Path(row["packages"]["facade"]).resolve().is_relative_to(real0x.ROOT)
    assert row["0x"]["ok"] is False and "fake 0.x" in row["0x"]["error"]
    assert row["facade"]["ok"] and len(row["facade"]["values"]["eigenvals"]) == 5
    assert "0.x crashed" in (out / "real0x.md").read_text()


def test_refuses_this_repository_or_a_folder_of_it_as_0x() -> None:
    for path in (real0x.ROOT, real0x.ROOT / "compat"):
        with pytest.raises(SystemExit):
            real0x.main(["--real-0x", str(path)])
