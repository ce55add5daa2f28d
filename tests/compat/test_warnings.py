"""Deprecation warnings: category, message, location, once per call site, removal date."""

from __future__ import annotations

import inspect
import warnings

import deprecation
import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings import compat
from hessian_eigenthings.compat import CPUFallbackWarning
from tests.compat.cases import mlp_problem


def _op() -> compat.LambdaOperator:
    with pytest.warns(deprecation.DeprecatedWarning):
        return compat.LambdaOperator(lambda v: 2.0 * v, 12)


# (name in the message, call, replacement words)
def _calls() -> list[tuple[str, object]]:
    model, criterion, data = mlp_problem()
    return [
        (
            "compute_hessian_eigenthings",
            lambda: compat.compute_hessian_eigenthings(model, data, criterion, 1, use_gpu=False),
        ),
        ("HVPOperator", lambda: compat.HVPOperator(model, data, criterion, use_gpu=False)),
        ("LambdaOperator", lambda: compat.LambdaOperator(lambda v: v, 3)),
        ("power_iteration", lambda: compat.power_iteration(_op(), use_gpu=False)),
        (
            "deflated_power_iteration",
            lambda: compat.deflated_power_iteration(_op(), 2, use_gpu=False),
        ),
        ("lanczos", lambda: compat.lanczos(_op(), 2)),
        ("log", lambda: compat.log("x")),
        ("maybe_fp16", lambda: compat.maybe_fp16(torch.ones(2), True)),
        ("progress_bar", lambda: compat.progress_bar(0, 1)),
        ("format_time", lambda: compat.format_time(1.0)),
    ]


NAMES = [name for name, _ in _calls()]


@deprecation.fail_if_not_removed
@pytest.mark.parametrize("name", NAMES)
def test_category_message_and_location(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    call = dict(_calls())[name]
    with pytest.warns(deprecation.DeprecatedWarning) as rec:
        call()  # type: ignore[operator]
    mine = [r for r in rec if name in str(r.message)]
    assert len(mine) == 1
    assert issubclass(mine[0].category, DeprecationWarning)
    text = str(mine[0].message)
    entry = compat.DEPRECATIONS[name]
    assert "deprecated as of 1.0.0" in text and "removed in 2.0.0" in text
    assert entry.replacement in text
    assert f"migration_guide.md, section '{entry.section}'" in text
    assert mine[0].filename == __file__  # points at this line's file: the user's code


def test_every_section_named_by_a_warning_exists_in_the_guide() -> None:
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "migration_guide.md").read_text()
    headings = {line.lstrip("#").strip() for line in guide.splitlines() if line.startswith("## ")}
    for entry in compat.DEPRECATIONS.values():
        assert entry.section in headings, entry.section
    assert "Devices and dtypes" in headings


def test_warning_points_at_the_calling_line() -> None:
    with pytest.warns(deprecation.DeprecatedWarning) as rec:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        compat.format_time(2.0)
    assert (rec[0].filename, rec[0].lineno) == (__file__, line)


def test_subclass_warns_at_construction_even_without_super_init() -> None:
    class Legacy(compat.Operator):
        def __init__(self, n: int) -> None:  # 0.x subclasses often skipped super().__init__
            self.size = n

        def apply(self, vec: torch.Tensor) -> torch.Tensor:
            return vec

    with pytest.warns(deprecation.DeprecatedWarning, match="Operator") as rec:
        op = Legacy(4)
    assert len(rec) == 1 and rec[0].filename == __file__
    assert torch.equal(op.matvec(torch.ones(4)), torch.ones(4))  # using it does not warn again


def test_once_per_call_site_under_the_default_filter() -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            compat.format_time(1.0)  # one call site, three calls
        compat.format_time(1.0)  # a second call site
    assert [r.lineno for r in rec if issubclass(r.category, deprecation.DeprecatedWarning)] == [
        rec[0].lineno,
        rec[0].lineno + 1,
    ]


def test_routed_0x_call_points_at_the_user_line() -> None:
    with pytest.warns(deprecation.DeprecatedWarning) as rec:
        he.lanczos(_op(), 2)
    assert all(r.filename == __file__ for r in rec)


def test_1x_path_never_warns() -> None:
    op = he.LambdaOperator(lambda v: 2.0 * v, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        he.lanczos(op, k=2)
        he.deflated_power_iteration(op, k=1, max_iter=5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback only happens without CUDA")
def test_use_gpu_without_cuda_warns_and_runs_on_cpu() -> None:
    model, criterion, data = mlp_problem()
    with (
        pytest.warns(CPUFallbackWarning, match="use_gpu=True") as fallback,
        pytest.warns(deprecation.DeprecatedWarning),
    ):
        op = compat.HVPOperator(model, data, criterion)  # 0.x default use_gpu=True
    assert op.device.type == "cpu"
    assert [r.filename for r in fallback if r.category is CPUFallbackWarning] == [__file__]


def test_removal_release_turns_warnings_into_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(he, "__version__", "2.0.0rc1")

    @deprecation.fail_if_not_removed
    def uses_the_facade() -> None:
        compat.format_time(1.0)

    with pytest.raises(AssertionError, match="should be removed"):
        uses_the_facade()


@pytest.mark.parametrize("version", ["1.0.0rc1", "1.0.0", "1.4.2"])
def test_1x_releases_warn_deprecated(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(he, "__version__", version)
    with pytest.warns(deprecation.DeprecatedWarning) as rec:
        compat.format_time(1.0)
    assert not isinstance(rec[0].message, deprecation.UnsupportedWarning)


def test_messages_naming_both_solvers_lead_with_lanczos() -> None:
    # third new-user pass: compute_hessian_eigenthings' warning named deflated_power_iteration
    # (18.5 s, 2 of 5 pairs unconverged on the user's model) before lanczos (2.2 s)
    from hessian_eigenthings.compat._deprecations import message

    both = [
        message(name)
        for name in compat.DEPRECATIONS
        if "lanczos(" in message(name) and "deflated_power_iteration(" in message(name)
    ]
    assert both, "compute_hessian_eigenthings' message names both solvers"
    for text in both:
        assert text.index("lanczos(") < text.index("deflated_power_iteration("), text
    model, criterion, data = mlp_problem()
    with pytest.warns(deprecation.DeprecatedWarning), pytest.raises(ValueError) as info:
        compat.compute_hessian_eigenthings(model, data, criterion, 1, mode="eigsh", use_gpu=False)
    text = str(info.value)
    assert text.index("lanczos(") < text.index("deflated_power_iteration("), text
