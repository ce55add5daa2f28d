"""The legacy clients in compat/ run unchanged, warn where they should, and agree with the 1.0 core.

Each script runs twice: in a subprocess exactly as a user runs it (exit code,
warnings on stderr under Python's default filters), and in-process through
``runpy`` so its results can be compared with the 1.0 core on its own model
and data.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deprecation
import numpy as np
import pytest
import torch

from hessian_eigenthings import algorithms
from hessian_eigenthings.compat import CPUFallbackWarning
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "compat"
WARNING_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<category>\w+): (?P<message>.*)$")


def _hessian_spectrum(g: dict[str, Any]) -> np.ndarray:
    op = HessianOperator(g["model"], g["dataloader"], supervised_loss(g["criterion"]))
    # the model may sit on CUDA (use_gpu moves it there, as 0.x did)
    return np.linalg.eigvalsh(op.to_dense().double().cpu().numpy())


def _top_by_magnitude(spectrum: np.ndarray, k: int) -> np.ndarray:
    return np.sort(spectrum[np.argsort(-np.abs(spectrum))[:k]])[::-1]


def check_mlp_power_iter(g: dict[str, Any]) -> None:
    np.testing.assert_allclose(
        g["eigenvals"], _top_by_magnitude(_hessian_spectrum(g), 3), rtol=1e-3
    )


def check_cnn_lanczos(g: dict[str, Any]) -> None:
    op = HessianOperator(g["model"], g["dataloader"], supervised_loss(g["criterion"]))
    core = algorithms.lanczos(op, k=4, tol=1e-6)
    np.testing.assert_allclose(
        g["eigenvals"], np.sort(core.eigenvalues.numpy()), rtol=1e-4, atol=1e-6
    )


def check_custom_operator(g: dict[str, Any]) -> None:
    np.testing.assert_allclose(g["eigenvals"], [10.1, 6.1, 3.1], rtol=1e-4)
    with (
        warnings.catch_warnings()
    ):  # the core judges deflated pairs by their true residual, strictly
        warnings.simplefilter("ignore", algorithms.ConvergenceWarning)
        core = algorithms.deflated_power_iteration(
            g["operator"], k=3, max_iter=200, tol=3e-4, seed=0
        )
    np.testing.assert_allclose(g["eigenvals"], np.sort(core.eigenvalues.numpy())[::-1], rtol=1e-4)


def check_lanczos_smallest(g: dict[str, Any]) -> None:
    np.testing.assert_allclose(g["eigenvals"], g["spectrum"][:3].numpy(), atol=1e-4)
    core = algorithms.lanczos(g["operator"], k=3, which="SA", tol=1e-6, v0=g["init_vec"])
    np.testing.assert_allclose(g["eigenvals"], core.eigenvalues.numpy(), atol=1e-5)


def check_hvp_minibatch(g: dict[str, Any]) -> None:
    for batch, product in zip(g["batches"], g["products"], strict=True):
        core = HessianOperator(g["model"], [batch], supervised_loss(g["criterion"])).matvec(
            g["vec"]
        )
        torch.testing.assert_close(product, core)
    g = {**g, "dataloader": g["batches"]}
    assert g["eigenval"] == pytest.approx(_top_by_magnitude(_hessian_spectrum(g), 1)[0], rel=1e-3)


def check_fp16_hvp(g: dict[str, Any]) -> None:
    assert g["eigenvecs"].dtype == np.float16
    np.testing.assert_allclose(
        g["eigenvals"], _top_by_magnitude(_hessian_spectrum(g), 2), rtol=2e-2
    )


def check_gpu_flag_on_cpu(g: dict[str, Any]) -> None:
    spectrum = _hessian_spectrum(g)
    np.testing.assert_allclose(g["eigenvals"], _top_by_magnitude(spectrum, 2), rtol=1e-3)
    np.testing.assert_allclose(
        g["lanczos_vals"], np.sort(_top_by_magnitude(spectrum, 2)), rtol=1e-4
    )


def check_readme_cnn_default_gpu(g: dict[str, Any]) -> None:
    g = {**g, "model": g["net"], "dataloader": g["loader"], "criterion": g["loss"]}
    # 10 steps with 0.x's default threshold: 1e-4 relative, as the threshold asks
    np.testing.assert_allclose(
        g["eigenvals"], _top_by_magnitude(_hessian_spectrum(g), 3), rtol=1e-4
    )
    assert g["eigenvecs"].shape == (3, sum(p.numel() for p in g["net"].parameters()))
    on_cuda = torch.cuda.is_available()  # 0.x moved the CPU-built model there: so does the facade
    assert all(p.is_cuda == on_cuda for p in g["net"].parameters())


def check_lanczos_microbatch(g: dict[str, Any]) -> None:
    spectrum = _hessian_spectrum(g)
    assert g["eigenvals"].dtype == np.float32  # 0.x's ARPACK ran on float32 products
    np.testing.assert_allclose(g["eigenvals"], np.sort(_top_by_magnitude(spectrum, 5)), rtol=1e-4)
    assert g["top"][0] == g["eigenvals"][-1]


def check_fixed_steps_numpy(g: dict[str, Any]) -> None:
    # to_numpy=False: numpy arrays all the same, as 0.x (np.array of the collected results)
    assert isinstance(g["eigs"], np.ndarray) and isinstance(g["vecs"], np.ndarray)
    np.testing.assert_allclose(g["eigs"], _top_by_magnitude(_hessian_spectrum(g), 2), rtol=1e-4)
    np.testing.assert_allclose(g["norms"], 1.0, rtol=1e-5)


# script -> (check of its numbers, 0.x names that must warn, CPU fallback warnings expected)
SCRIPTS: dict[str, tuple[Callable[[dict[str, Any]], None], set[str], int]] = {
    "mlp_power_iter.py": (check_mlp_power_iter, {"compute_hessian_eigenthings"}, 1),
    "cnn_lanczos.py": (check_cnn_lanczos, {"compute_hessian_eigenthings"}, 0),
    "custom_operator.py": (check_custom_operator, {"Operator", "deflated_power_iteration"}, 0),
    "lanczos_smallest.py": (check_lanczos_smallest, {"LambdaOperator", "lanczos"}, 0),
    "hvp_minibatch.py": (
        check_hvp_minibatch,
        {"HVPOperator", "progress_bar", "log", "format_time", "power_iteration"},
        0,
    ),
    "fp16_hvp.py": (check_fp16_hvp, {"compute_hessian_eigenthings"}, 0),
    "gpu_flag_on_cpu.py": (
        check_gpu_flag_on_cpu,
        {"HVPOperator", "deflated_power_iteration", "lanczos"},
        3,
    ),
    "readme_cnn_default_gpu.py": (check_readme_cnn_default_gpu, {"compute_hessian_eigenthings"}, 1),
    "lanczos_microbatch.py": (check_lanczos_microbatch, {"compute_hessian_eigenthings"}, 0),
    "fixed_steps_numpy.py": (
        check_fixed_steps_numpy,
        {"HVPOperator", "deflated_power_iteration"},
        0,
    ),
}


def test_corpus_is_complete() -> None:
    assert {p.name for p in CORPUS.glob("*.py")} == set(SCRIPTS)


def _deprecated_name(message: str) -> str:
    match = re.search(r"0\.x (\w+) is deprecated", message)
    assert match, message
    return match.group(1)


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: Python's default warning filters, this checkout importable."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTEST_CURRENT_TEST")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_runs_unchanged_and_warns_at_its_own_lines(script: str) -> None:
    path = CORPUS / script
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_user_env(),
    )
    assert proc.returncode == 0, proc.stderr
    found = [m.groupdict() for line in proc.stderr.splitlines() if (m := WARNING_LINE.match(line))]
    assert found, proc.stderr
    assert all(Path(w["file"]) == path for w in found), (
        found
    )  # every warning points into the script
    sites = Counter((w["line"], w["category"], w["message"]) for w in found)
    assert max(sites.values()) == 1  # once per call site
    _, names, fallbacks = SCRIPTS[script]
    deprecated = {
        _deprecated_name(w["message"]) for w in found if w["category"] == "DeprecatedWarning"
    }
    assert deprecated == names
    cpu = [w for w in found if w["category"] == "CPUFallbackWarning"]
    assert len(cpu) == (fallbacks if not torch.cuda.is_available() else 0)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_numbers_agree_with_the_core(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    check, _, _ = SCRIPTS[script]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g = runpy.run_path(str(CORPUS / script), run_name="__main__")
    categories = {r.category for r in rec}
    assert deprecation.DeprecatedWarning in categories
    assert categories <= {deprecation.DeprecatedWarning, CPUFallbackWarning}, [
        str(r.message) for r in rec
    ]
    check(g)
