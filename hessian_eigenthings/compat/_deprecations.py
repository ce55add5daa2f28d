"""Every deprecation of the 0.x facade, in one table, and the one function that warns.

Each entry names the 0.x spelling, its 1.0 replacement and the section of
``migration_guide.md`` that shows the change. The warning classes come from
the ``deprecation`` package, so ``deprecation.fail_if_not_removed`` turns a
test red once ``__version__`` reaches ``REMOVED_IN`` and the facade is still
here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import warnings
from dataclasses import dataclass

import deprecation
from packaging.version import Version

from hessian_eigenthings._version import __version__

#: the first release that ships the facade (its pre-releases count as that release)
DEPRECATED_IN = "1.0.0"
#: the release that deletes ``hessian_eigenthings.compat`` and the old import paths
REMOVED_IN = "2.0.0"
GUIDE = "migration_guide.md"


@dataclass(frozen=True)
class Deprecation:
    name: str  # the 0.x spelling, as the user wrote it
    replacement: str  # what to write instead in 1.0
    section: str  # heading of migration_guide.md that shows before/after


def _entry(name: str, replacement: str, section: str | None = None) -> tuple[str, Deprecation]:
    return name, Deprecation(name, replacement, section or name)


# One entry per deprecated 0.x name; the comment dates when it was added.
DEPRECATIONS: dict[str, Deprecation] = dict(
    [
        # 2026-11-22 (1.0.0): the 0.x driver
        _entry(
            "compute_hessian_eigenthings",
            "op = HessianOperator(model, dataloader, supervised_loss(criterion)) followed by "
            "lanczos(op, k=...) (fewer products, tighter answers; mode='power_iter' was "
            "deflated_power_iteration(op, k=...))",
        ),
        # 2026-11-22 (1.0.0): 0.x operators
        _entry(
            "HVPOperator",
            "HessianOperator(model, dataloader, supervised_loss(criterion), full_dataset=..., "
            "microbatch_size=...) and op.matvec(v)",
        ),
        _entry(
            "Operator",
            "a subclass of hessian_eigenthings.CurvatureOperator that implements _matvec(v), "
            "or hessian_eigenthings.LambdaOperator(matvec_fn, size, device, dtype)",
        ),
        _entry(
            "LambdaOperator",
            "hessian_eigenthings.LambdaOperator(matvec_fn, size, device=..., dtype=...)",
            "Operator",
        ),
        # 2026-11-22 (1.0.0): 0.x algorithms; the top-level names route by signature
        _entry(
            "power_iteration",
            "power_iteration_one(op, max_iter=..., tol=..., momentum=..., init=...), "
            "which returns (eigenvalue, eigenvector, residual, iterations, converged)",
        ),
        _entry(
            "deflated_power_iteration",
            "deflated_power_iteration(op, k=..., max_iter=..., tol=...) with a 1.0 operator, "
            "which returns an EigenResult",
        ),
        _entry(
            "lanczos",
            "lanczos(op, k=..., which=..., max_iter=..., tol=...) with a 1.0 operator, which "
            "returns an EigenResult",
        ),
        # 2026-11-22 (1.0.0): 0.x helpers in hessian_eigenthings.utils
        _entry("log", "the logging module", "utils"),
        _entry("maybe_fp16", "tensor.to(torch.float16)", "utils"),
        _entry("progress_bar", "tqdm (the 1.0 algorithms take progress=True)", "utils"),
        _entry("format_time", "str(datetime.timedelta(seconds=...))", "utils"),
    ]
)


class CPUFallbackWarning(UserWarning):
    """``use_gpu=True`` on a machine without CUDA: the facade runs on the CPU (0.x crashed)."""


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the caller of this function,
    such that the warning points at the first frame outside this package.

    The facade routes calls through a few frames (top-level router, 0.x
    function, translation helpers); counting them by hand at every call site
    would break whenever one moves.
    """
    level = 1
    frame = sys._getframe(1)  # the function that will call warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _current_version() -> str:
    # read at call time from the package, so a test can pretend to be a later release
    package = sys.modules.get("hessian_eigenthings")
    return str(getattr(package, "__version__", __version__))


def _removed() -> bool:
    return _removed_at(_current_version())


@functools.lru_cache(maxsize=8)
def _removed_at(version: str) -> bool:
    # 1.0.0rc1 ships the facade, so compare release numbers and ignore the pre-release tag;
    # likewise a 2.0.0 pre-release must already be free of it. Cached per version string:
    # parsing three versions on every 0.x call cost ~5 us of facade overhead.
    current = Version(Version(version).base_version)
    return current >= Version(REMOVED_IN)


def message(name: str) -> str:
    """The text of the warning for ``name``: replacement and guide section."""
    entry = DEPRECATIONS[name]
    return f"Use {entry.replacement}. See {GUIDE}, section '{entry.section}'."


# NOTE [once per call site]
# Python shows a DeprecationWarning once per call site by recording it in the calling
# module's __warningregistry__; any change of the filter list (warnings.simplefilter,
# entering or leaving warnings.catch_warnings) invalidates every registry, and the next
# call warns again. The facade's own path changes no filter. Two libraries do, once, at
# import time, and the core imports them lazily during its first product: tqdm.auto (the
# progress bar) and torch.fx.experimental.symbolic_shapes (torch.autograd.grad imports it,
# and it imports sympy). Imported during the first 0.x call, after its warning, they
# cleared that record, so a loop warned twice. Importing them before the first warning
# settles the filters first; later calls find them loaded (a dict lookup each).
# (The first trace of a process loads torch's forward-mode decompositions, which warn through
# the deprecated torch.jit.script; `_torch_compat.load_forward_ad_decompositions` drops that
# warning where it is shown, without touching the filters, so it clears no record.)
_FILTER_CHANGING_IMPORTS = ("tqdm.auto", "torch.fx.experimental.symbolic_shapes")


def _settle_lazy_imports() -> None:
    for module in _FILTER_CHANGING_IMPORTS:
        if module not in sys.modules:
            # an optional dependency absent: nothing will import it
            with contextlib.suppress(ImportError):
                importlib.import_module(module)


def warn_deprecated(name: str) -> None:
    """Warn that the 0.x ``name`` was used, pointing at the user's line.

    Python's default filter shows a ``DeprecationWarning`` once per call site
    (when the call site is ``__main__``); no state is kept here. See NOTE [once
    per call site].
    """
    _settle_lazy_imports()
    entry = DEPRECATIONS[name]
    cls = deprecation.UnsupportedWarning if _removed() else deprecation.DeprecatedWarning
    warning = cls(f"hessian_eigenthings 0.x {entry.name}", DEPRECATED_IN, REMOVED_IN, message(name))
    warnings.warn(warning, stacklevel=user_stacklevel())


def warn_cpu_fallback(what: str) -> None:
    """``use_gpu=True`` but CUDA is unavailable: say so once per call site, then run on the CPU."""
    warnings.warn(
        f"{what}: use_gpu=True (0.x's default, in effect when use_gpu is not passed) but CUDA is "
        "not available; running on the CPU (0.x raised an error here). Pass use_gpu=False to "
        "silence this; in 1.0 computations run on the model's device: drop use_gpu and move the "
        f"model with model.to(device). See {GUIDE}, section 'Devices and dtypes'.",
        CPUFallbackWarning,
        stacklevel=user_stacklevel(),
    )
