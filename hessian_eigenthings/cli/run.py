"""The run: the problem, its operator, then the eigenvalues, the trace, the spectral density
and a loss landscape, each reported as it comes; the JSON document and the figures at the end.
``main`` is the command's entry point."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings._version import __version__
from hessian_eigenthings.algorithms import lanczos, spectral_density, trace
from hessian_eigenthings.algorithms.result import EigenResult, SpectralDensityResult, TraceResult
from hessian_eigenthings.batching import batch_size
from hessian_eigenthings.cli import plots
from hessian_eigenthings.cli.builders import build_operator
from hessian_eigenthings.cli.output import Destination, floats, guarded_run, json_default
from hessian_eigenthings.cli.parser import DTYPES, build_parser, check_args
from hessian_eigenthings.cli.problems import (
    CLIError,
    Problem,
    ScalarCriterion,
    builtin_problem,
    cast_data,
    first_batch,
    load_user_problem,
)
from hessian_eigenthings.landscape import LandscapeResult, loss_landscape
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.memory import MemoryEstimate, estimate_memory
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["main", "resolve_device", "run"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CLIError(
            f"--device: unknown device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return device


def _data_used(data: Iterable[Any], num_batches: int | None) -> tuple[int, int] | None:
    """(samples, batches) one product reads; ``None`` when that would need an extra pass
    over a loader of unknown size."""
    if num_batches is None and not isinstance(data, (list, tuple)):
        return None
    samples = batches = 0
    for batch in itertools.islice(data, num_batches):
        samples += batch_size(batch)
        batches += 1
    return samples, batches


def _log(quiet: bool, *parts: Any) -> None:
    if not quiet:
        print(*parts, flush=True)


def _memory_estimate(
    problem: Problem, op: CurvatureOperator, args: argparse.Namespace
) -> MemoryEstimate | None:
    first = first_batch(problem)
    n = op.size
    # the algorithms run one after another: the largest set of kept vectors counts
    krylov = min(n, max(2 * args.k + 1, 20))
    if args.slq_runs:
        krylov = max(krylov, args.slq_runs * min(args.slq_steps, n))
    if args.trace_matvecs:
        krylov = max(krylov, args.trace_matvecs // 3)
    block = max(1, min(args.slq_runs, 32))
    return estimate_memory(
        problem.model,
        first,
        supervised_loss(problem.criterion),
        operator=args.operator,
        method=args.method,
        block_size=block,
        microbatch_size=args.microbatch_size,
        krylov_size=krylov,
        # the selected parameters: data operators and the Kronecker-factored ones both keep them
        params=getattr(op, "params", None),
    )


def _wanted_positions(values: torch.Tensor, k: int, which: str) -> torch.Tensor:
    """Positions in ``values`` (ascending) of the ``k`` wanted eigenvalues, most wanted first."""
    n = values.shape[0]
    if which == "LA":
        return torch.arange(n - 1, n - 1 - min(k, n), -1)
    if which == "SA":
        return torch.arange(min(k, n))
    return values.abs().argsort(descending=True, stable=True)[:k]


def _exact_eigenvalues(op: Any, k: int, which: str) -> torch.Tensor:
    """The ``k`` wanted eigenvalues of the operator's own eigendecomposition, most wanted first."""
    values = op.eigh().eigenvalues.detach().to("cpu", torch.float64)  # (n,) ascending
    return values[_wanted_positions(values, k, which)]


def _exact_eigenpairs(op: Any, k: int, which: str) -> EigenResult:
    """The ``k`` wanted eigenpairs of a Kronecker-factored operator from its factors'
    eigendecompositions (``eigh().locate`` and ``eigenvector``): exact, no product."""
    eigen = op.eigh()
    values = eigen.eigenvalues.detach().to("cpu", torch.float64)  # (n,) ascending
    positions = _wanted_positions(values, k, which)
    vectors = torch.stack([op.eigenvector(*eigen.locate(int(p))) for p in positions])
    return EigenResult(
        eigenvalues=values[positions],
        eigenvectors=vectors,
        residuals=torch.zeros(len(positions), dtype=torch.float64),
        iterations=0,
        converged=torch.ones(len(positions), dtype=torch.bool),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the computation for parsed options; returns what is written to ``results.json``.

    With ``-o -`` the report goes to stderr and the JSON document to stdout."""
    stdout = sys.stdout
    if str(args.output) != "-":
        return _run(args)
    with contextlib.redirect_stdout(sys.stderr):
        results = _run(args)
    json.dump(results, stdout, indent=1, default=json_default)
    stdout.write("\n")
    stdout.flush()
    return results


@dataclass
class _Steps:
    """What the steps of one run share: the options, the operator and what they report."""

    args: argparse.Namespace
    op: CurvatureOperator
    results: dict[str, Any]  # the JSON document, in the order it is written
    timings: dict[str, float]
    quiet: bool
    progress: bool | None


def _run(args: argparse.Namespace) -> dict[str, Any]:
    destination = Destination(args.output)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or "float32"]
    quiet = args.quiet
    progress = False if quiet else args.progress
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    problem = _problem(args, device, dtype)
    timings["setup"] = time.perf_counter() - t0
    _log(quiet, f"model: {problem.description}  [{timings['setup']:.1f} s]")
    op, results, notes = _operator(args, problem, device, quiet)
    s = _Steps(args, op, results, timings, quiet, progress)
    values, eig, exact = _eigenvalues(s)
    tr = _trace(s, exact)
    density = _density(s)
    land = _landscape(s, problem, eig)
    results["timings_s"] = timings
    results["total_matvecs"] = op.num_matvecs
    written = _write(s, destination, problem, notes, (values, density, tr, exact), land)
    timings["total"] = time.perf_counter() - t0
    # also under -q: where the results went is the one thing a quiet run must say
    if not quiet:
        print()
    if destination.to_stdout:
        written.append("the JSON to stdout")
    print(f"wrote {', '.join(written)}  (total {timings['total']:.1f} s)", flush=True)
    return results


def _problem(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Problem:
    """The built-in problem, or the user's moved to the run's device (and dtype when given)."""
    if args.model is None:
        problem = builtin_problem(
            seed=args.seed,
            dtype=dtype,
            device=device,
            train_steps=args.train_steps,
            synthetic=args.synthetic,
        )
    else:
        problem = load_user_problem(args.model)
        if args.dtype is not None:
            problem.model.to(dtype=dtype)
        problem.model.to(device=device)
        problem.dataloader = cast_data(
            problem.dataloader, device, dtype if args.dtype is not None else None
        )
        first_batch(problem)
        if not isinstance(problem.criterion, nn.Module):
            # nn losses keep their type (the GGN recognises cross-entropy and MSE); their
            # reduction was checked when loading
            problem.criterion = ScalarCriterion(problem.criterion)
    return problem


def _operator(
    args: argparse.Namespace, problem: Problem, device: torch.device, quiet: bool
) -> tuple[CurvatureOperator, dict[str, Any], str]:
    """The operator, reported with the data it reads and a memory estimate; the JSON document's
    head; the figure's note on the data."""
    op = build_operator(
        problem,
        args.operator,
        method=args.method,
        num_batches=args.num_batches,
        microbatch_size=args.microbatch_size,
    )
    if args.k > op.size:
        hint = (
            f"; for all {op.size} eigenvalues at this size, form the dense matrix in Python "
            "(H = op @ torch.eye(op.size, dtype=op.dtype)) and call torch.linalg.eigvalsh(H)"
            if op.size <= 10_000
            else ""
        )
        raise CLIError(
            f"-k {args.k}: k must be between 1 and the operator size n = {op.size}{hint}"
        )
    what = f"{args.operator}" + (
        f" ({args.method})" if registry.curvature(args.operator).methods else ""
    )
    _log(
        quiet,
        f"operator: {what}, n = {op.size} parameters, {str(op.dtype).removeprefix('torch.')} on {device}",
    )
    used = _data_used(problem.dataloader, args.num_batches)
    dtype_name = str(op.dtype).removeprefix("torch.")
    data_line = (
        "all batches of the dataloader"
        if used is None
        else f"{used[0]} samples in {used[1]} batch{'es' if used[1] != 1 else ''}"
    )
    _log(
        quiet,
        f"data per product: {data_line}"
        + (f" (--num-batches {args.num_batches})" if args.num_batches else ""),
    )
    if device.type == "cpu":
        _log(quiet, _threads_line(args.threads))
    memory = _memory_estimate(problem, op, args)
    if memory is not None:
        _log(quiet, memory.summary())

    results: dict[str, Any] = {
        "version": __version__,
        "torch_threads": torch.get_num_threads(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {
            "description": problem.description,
            "num_parameters": op.size,
            "device": str(device),
            "dtype": dtype_name,
        },
        "data": None if used is None else {"samples": used[0], "batches": used[1]},
        "memory_estimate": None
        if memory is None
        else {**asdict(memory), "required_bytes": memory.required_bytes, "fits": memory.fits},
    }
    return op, results, f"data: {data_line}, {dtype_name} on {device}"


def _threads_line(asked: int | None) -> str:
    """The CPU threads torch runs with, and how to change them: torch's default (one per core)
    is often several times slower than 1 on a small or busy machine (docs/howto/speed.md)."""
    n = torch.get_num_threads()
    threads = f"cpu: {n} torch thread{'s' if n != 1 else ''}"
    if asked is not None:
        return f"{threads} (--threads {asked})"
    return f"{threads} (torch's default; --threads N to change, 1 is often fastest on a busy or small machine)"


def _eigenvalues(s: _Steps) -> tuple[torch.Tensor, EigenResult | None, bool]:
    """The wanted eigenvalues (exact for a Kronecker-factored operator), the Lanczos result
    when one ran, and whether the eigenvalues are exact."""
    args, op, results, timings = s.args, s.op, s.results, s.timings
    quiet, progress = s.quiet, s.progress
    t = time.perf_counter()
    k = args.k
    # NOTE [exact factored spectrum]: a Kronecker-factored operator diagonalises block by block
    # (eigendecompositions of its small factors, computed once): its eigenvalues and trace are
    # exact and cost no product, where Lanczos spent 187 products for k = 50 and Hutch++ only
    # estimates. The spectral density stays SLQ (a smoothed histogram of all n eigenvalues
    # would be the same picture, but SLQ is what the other operators show); a landscape's
    # eigenvectors come from the same decomposition (`eigenvector`, in the flat layout).
    exact = registry.curvature(args.operator).factored and callable(getattr(op, "eigh", None))
    eig: EigenResult | None = None
    if exact:
        values = _exact_eigenvalues(op, k, args.which)
        timings["eigenvalues"] = time.perf_counter() - t
        results["eigenvalues"] = {
            "which": args.which,
            "method": "eigh",
            "values": floats(values),
            "matvecs": 0,
        }
        _log(
            quiet,
            f"\n{plots.WHICH_WORDS[args.which][0].format(k=k)} (exact eigendecomposition of the Kronecker "
            f"factors, 0 products) [{timings['eigenvalues']:.1f} s]",
        )
        table = ["    i   eigenvalue"] + [f"{i:5d}  {float(v): .6e}" for i, v in enumerate(values)]
        _log(quiet, "\n".join(table))
    if exact and args.landscape != "none":
        eig = _exact_eigenpairs(op, min(k, 1 if args.landscape == "1d" else 2), args.which)
        results["eigenvectors"] = {"method": "eigh", "matvecs": 0}
        _log(
            quiet, "eigenvectors for the landscape: exact, from the Kronecker factors (0 products)"
        )
    if not exact:
        eig = lanczos(
            op,
            k=k,
            which=args.which,
            tol=args.tol,
            max_iter=args.max_matvecs,
            seed=args.seed,
            progress=progress,
        )
        values = eig.eigenvalues
        timings["eigenvalues"] = time.perf_counter() - t
        results["eigenvalues"] = {
            "which": args.which,
            "method": "lanczos",
            "values": floats(eig.eigenvalues),
            "residuals": floats(eig.residuals),
            "converged": [bool(c) for c in eig.converged.tolist()],
            "tol": eig.tol,
            "residual_floor": eig.residual_floor,
            "converged_by_floor": [bool(c) for c in eig.floor_only().tolist()],
            "matvecs": eig.iterations,
        }
        _log(
            quiet,
            f"\n{plots.WHICH_WORDS[args.which][0].format(k=k)} (Lanczos, which={args.which}, {eig.iterations} products) [{timings['eigenvalues']:.1f} s]",
        )
        _log(quiet, eig.summary())
    return values, eig, exact


def _trace(s: _Steps, exact: bool) -> TraceResult | None:
    args, op, results, timings = s.args, s.op, s.results, s.timings
    quiet, progress = s.quiet, s.progress
    tr: TraceResult | None = None
    if args.trace_matvecs and exact:
        t = time.perf_counter()
        estimate = float(cast(Any, op).trace())  # the factored operators have trace()
        timings["trace"] = time.perf_counter() - t
        tr = TraceResult(estimate=estimate, stderr=0.0, samples=torch.empty(0, dtype=torch.float64))
        results["trace"] = {"method": "exact", "estimate": estimate, "stderr": 0.0, "matvecs": 0}
        _log(
            quiet,
            f"\ntrace (exact, from the Kronecker factors, 0 products): {estimate:.6e}  [{timings['trace']:.1f} s]",
        )
    elif args.trace_matvecs:
        t = time.perf_counter()
        tr = trace(
            op, num_matvecs=args.trace_matvecs, method="hutch++", seed=args.seed, progress=progress
        )
        timings["trace"] = time.perf_counter() - t
        results["trace"] = {
            "method": "hutch++",
            "estimate": tr.estimate,
            "stderr": tr.stderr,
            "matvecs": args.trace_matvecs,
        }
        _log(
            quiet,
            f"\ntrace (Hutch++, {args.trace_matvecs} products): {tr.estimate:.6e} ± {tr.stderr:.2e}  [{timings['trace']:.1f} s]",
        )
    return tr


def _density(s: _Steps) -> SpectralDensityResult | None:
    args, op, results, timings = s.args, s.op, s.results, s.timings
    quiet, progress = s.quiet, s.progress
    density: SpectralDensityResult | None = None
    if args.slq_runs:
        t = time.perf_counter()
        density = spectral_density(
            op,
            num_runs=args.slq_runs,
            lanczos_steps=args.slq_steps,
            num_grid_points=args.grid_points,
            seed=args.seed,
            progress=progress,
        )
        timings["spectral_density"] = time.perf_counter() - t
        grid = density.grid
        nodes, weights = density.quadrature()
        mass = float(torch.trapezoid(density.density, grid))
        results["spectral_density"] = {
            "num_runs": args.slq_runs,
            "lanczos_steps": args.slq_steps,
            "sigma": density.sigma,
            "grid": floats(grid),
            "density": floats(density.density),
            "nodes": floats(nodes),
            "weights": floats(weights),
        }
        lo, hi = float(nodes.min()), float(nodes.max())
        _log(
            quiet,
            f"\nspectral density (SLQ, {args.slq_runs} runs x {min(args.slq_steps, op.size)} steps): support "
            f"[{lo:.3e}, {hi:.3e}], sigma {density.sigma:.2e}, integrates to {mass:.3f}  "
            f"[{timings['spectral_density']:.1f} s]",
        )
    return density


def _landscape(s: _Steps, problem: Problem, eig: EigenResult | None) -> LandscapeResult | None:
    args, results, timings = s.args, s.results, s.timings
    quiet, progress = s.quiet, s.progress
    k = args.k
    land = None
    if args.landscape != "none":
        if eig is None:  # computed above whenever a landscape is asked for
            raise InternalError("eig is not None")
        dims = 1 if args.landscape == "1d" else 2
        wanted = plots.WHICH_WORDS[args.which][2]
        if k < dims:
            raise CLIError(
                f"--landscape {args.landscape} needs the {wanted} {dims} eigenvectors: pass -k {dims} or more"
            )
        steps = args.landscape_steps or 21
        t = time.perf_counter()
        land = loss_landscape(
            problem.model,
            problem.dataloader,
            supervised_loss(problem.criterion),
            directions=eig,
            dims=dims,
            span=args.landscape_span,
            steps=steps,
            num_batches=args.num_batches,
            progress=progress,
        )
        timings["landscape"] = time.perf_counter() - t
        results["landscape"] = {
            "dims": dims,
            "span": args.landscape_span,
            "alphas": floats(land.alphas),
            "losses": land.losses.tolist(),
            "center_loss": land.center_loss,
        }
        _log(
            quiet,
            f"\nloss landscape ({args.landscape}, {steps} points per axis along the {wanted} eigenvector"
            f"{'s' if dims == 2 else ''}, span {args.landscape_span:g}): loss {float(land.losses.min()):.4e} to "
            f"{float(land.losses.max()):.4e}, {land.center_loss:.4e} at the parameters  [{timings['landscape']:.1f} s]",
        )
    return land


def _write(
    s: _Steps,
    destination: Destination,
    problem: Problem,
    notes: str,
    spectrum: tuple[Any, SpectralDensityResult | None, TraceResult | None, bool],
    land: LandscapeResult | None,
) -> list[str]:
    """``results.json`` and the figures; returns what was written."""
    args, results = s.args, s.results
    values, density, tr, exact = spectrum
    written = []
    if not destination.to_stdout:
        out_dir = destination.folder
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(
                f"--output: cannot create folder {str(out_dir)!r}: {exc.strerror}"
            ) from None
        with open(destination.json, "w") as f:
            json.dump(results, f, indent=1, default=json_default)
        written.append(str(destination.json))
    if not args.no_plot and not destination.to_stdout:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "note: matplotlib is not installed, so no plot was written (results.json is complete); "
                "install it with `pip install hessian-eigenthings[plotting]`",
                file=sys.stderr,
            )
        else:
            png = destination.png("spectrum")
            title = f"{registry.curvature(args.operator).title} of {problem.description}"
            fig = plots.spectrum_figure(values, density, tr, args.which, title, notes, exact=exact)
            plots.save(png, fig)
            written.append(str(png))
            if land is not None:
                png = destination.png("landscape")
                plots.save(png, plots.landscape_figure(land))
                written.append(str(png))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hessian-eigenthings`` and ``python -m hessian_eigenthings``; a first
    argument ``influence`` runs that subcommand (``cli.influence``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["influence"]:
        # imported when asked for: the spectrum command's start-up stays as it was
        from hessian_eigenthings.cli import influence

        return influence.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return guarded_run(parser.prog, args.threads, lambda: run(args), CLIError)
