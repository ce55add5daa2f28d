"""The command's options: ``build_parser`` and the checks argparse cannot express."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from hessian_eigenthings._version import __version__
from hessian_eigenthings.operators import registry

__all__ = ["DTYPES", "build_parser", "check_args"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _int_at_least(minimum: int, expected: str) -> Callable[[str], int]:
    """An argparse ``type=``: an int ``>= minimum``, else an error saying ``expected ...``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def build_parser() -> argparse.ArgumentParser:
    """The command's options; the curvature choices come from the registry, read now."""
    parser = argparse.ArgumentParser(
        prog="hessian-eigenthings",
        description=(
            "Top eigenvalues (Lanczos), trace (Hutch++) and spectral density (stochastic Lanczos "
            "quadrature) of a model's loss curvature. Without --model: a small MLP trained on "
            "scikit-learn's bundled digits (no download), or synthetic data."
        ),
        epilog=(
            "--model contract: function() takes no arguments and returns (model, dataloader, "
            "criterion); the dataloader yields (inputs, targets) and can be iterated repeatedly; "
            "criterion(model(inputs), targets) is the scalar mean loss, e.g. nn.CrossEntropyLoss()."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _what_options(parser.add_argument_group("what to compute"))
    _model_options(parser.add_argument_group("model and data"))
    _run_options(parser.add_argument_group("run"))
    return parser


def _what_options(what: argparse._ArgumentGroup) -> None:
    # choices come from the curvature registry (operators/registry.py), read when the parser is built
    rows = registry.curvatures()
    what.add_argument(
        "--operator",
        choices=[row.name for row in rows],
        default="hessian",
        help="curvature: "
        + "; ".join(f"{row.name}: {row.title}" for row in rows)
        + " (default: hessian)",
    )
    methods = list(dict.fromkeys(m for row in rows for m in row.methods))
    what.add_argument(
        "--method",
        choices=methods,
        default=None,
        help="how products are computed, for the curvatures that have a choice ("
        + "; ".join(
            f"--operator {row.name}: {row.methods[0]} (default) or {', '.join(row.methods[1:])}"
            for row in rows
            if len(row.methods) > 1
        )
        + ")",
    )
    what.add_argument(
        "-k", "--k", type=_positive_int, default=10, help="number of top eigenvalues (default: 10)"
    )
    what.add_argument(
        "--which",
        choices=("LA", "LM", "SA"),
        default="LA",
        help="which eigenvalues: largest algebraic, largest magnitude, smallest algebraic (default: LA)",
    )
    what.add_argument(
        "--max-matvecs",
        type=_positive_int,
        default=None,
        help="product budget of the Lanczos eigensolver (default: the solver's own)",
    )
    what.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="relative residual tolerance of the eigenpairs (default: 1e-4)",
    )
    what.add_argument(
        "--trace-matvecs",
        type=_nonnegative_int,
        default=90,
        help="products spent on the Hutch++ trace estimate, >= 3; 0 skips it (default: 90)",
    )
    what.add_argument(
        "--slq-runs",
        type=_nonnegative_int,
        default=8,
        help="random start vectors of the spectral density; 0 skips it (default: 8)",
    )
    what.add_argument(
        "--slq-steps",
        type=_positive_int,
        default=60,
        help="Lanczos steps per spectral-density run (default: 60)",
    )
    what.add_argument(
        "--grid-points",
        type=_positive_int,
        default=2000,
        help="points of the density grid (default: 2000)",
    )

    what.add_argument(
        "--landscape",
        choices=("none", "1d", "2d"),
        default="none",
        help="also the loss along the top eigenvector (1d) or the top two (2d), written to "
        "landscape.png and results.json (default: none)",
    )
    what.add_argument(
        "--landscape-span",
        type=float,
        default=1.0,
        help="the slice covers [-span, span] along each unit eigenvector, a distance in parameter "
        "space (default: 1.0)",
    )
    what.add_argument(
        "--landscape-steps",
        type=_positive_int,
        default=None,
        help="points per axis of the slice (default: 21; a 2d slice of 21 x 21 points costs 441 "
        "forward passes over the data, no curvature products)",
    )


def _model_options(model: argparse._ArgumentGroup) -> None:
    model.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        default=None,
        help="your model: 'package.module:function' or 'path/to/file.py:function' returning "
        "(model, dataloader, criterion); see below",
    )
    model.add_argument(
        "--synthetic",
        action="store_true",
        help="built-in model on synthetic data even when scikit-learn is installed",
    )
    model.add_argument(
        "--train-steps",
        type=_nonnegative_int,
        default=100,
        help="full-batch Adam steps that train the built-in model (default: 100, a few seconds)",
    )
    model.add_argument(
        "--num-batches",
        type=_positive_int,
        default=None,
        help="use only the first N batches of the data for every product",
    )
    model.add_argument(
        "--microbatch-size",
        type=_positive_int,
        default=None,
        help="split batches into chunks of this many samples (same result, less memory)",
    )


def _run_options(run_opts: argparse._ArgumentGroup) -> None:
    run_opts.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model, the data and every algorithm (default: 0)",
    )
    run_opts.add_argument(
        "--device", default="auto", help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (default: auto)"
    )
    run_opts.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="working precision; model and floating-point data are cast to it (default: float32 for "
        "the built-in model, the model's own dtype for --model)",
    )
    run_opts.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("he_out"),
        help="where results go: a folder (results.json, spectrum.png, landscape.png in it); a path "
        "ending in .json (that file, with NAME.spectrum.png and NAME.landscape.png beside it); or '-' "
        "(the JSON on stdout, the report on stderr, no plot) (default: ./he_out)",
    )
    run_opts.add_argument("--no-plot", action="store_true", help="write no PNG")
    progress = run_opts.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show progress bars",
    )
    progress.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never show progress bars (default: only on a terminal)",
    )
    run_opts.add_argument(
        "-q", "--quiet", action="store_true", help="print only errors and the files written"
    )
    run_opts.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads of torch for this run (torch.set_num_threads); 1 is often fastest on a small "
        "or shared machine, see docs/howto/speed.md (default: torch's own setting)",
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    row = registry.curvature(args.operator)
    if args.method is None:
        # curvatures with one product method record "autograd", as before the registry
        args.method = row.methods[0] if row.methods else "autograd"
    elif args.method not in row.methods:
        owners = [r.name for r in registry.curvatures() if args.method in r.methods]
        parser.error(
            f"--method {args.method} applies to --operator {', '.join(owners)} only "
            f"({args.operator} has {'methods ' + ', '.join(row.methods) if row.methods else 'one product method'})"
        )
    if 0 < args.trace_matvecs < 3:
        parser.error(
            f"--trace-matvecs must be 0 (skip) or >= 3 (Hutch++ spends a third on a sketch), got {args.trace_matvecs}"
        )
    if not args.tol > 0:
        parser.error(f"--tol must be positive, got {args.tol}")
    if args.grid_points < 2:
        parser.error(f"--grid-points must be >= 2, got {args.grid_points}")
    if args.model is not None and args.synthetic:
        parser.error(
            "--synthetic selects data for the built-in model; it cannot be combined with --model"
        )
