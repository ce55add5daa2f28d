"""``hessian-eigenthings influence``: the most influential training examples of a few queries,
on a built-in tiny language model.

Nothing comes from the network: a two-layer GPT-2 (``transformers``, built from a config,
float64) is trained from ``--seed`` for ``--train-steps`` Adam steps on generated sentences
about four animals, tokenized by characters (``cli.influence_problem``). The run fits the
curvature of ``--strategy`` with :func:`hessian_eigenthings.influence.fit`, scores every query
against every training sentence with ``Influence.pairwise_scores``, prints each query's
``--top-k`` most negative (helpful) and most positive (harmful) training sentences, and writes
``influence.json`` and ``influence.png`` (a heat map of the scores with the top-k marked) to
``--out``. Signs follow NOTE [influence sign] of ``influence.scores``:
``score(q, z) = −∇L(q)ᵀ (C + λI)⁻¹ ∇L(z)``, negative when up-weighting ``z`` lowers the
query's loss.

The three strategies score the same parameters (those the Kronecker routes select: every
linear layer, the tied embedding / head left out), so they differ in the curvature only;
``ggn`` (exact, block CG) takes by default the damping EK-FAC's default would have
(``0.1 ·`` EK-FAC's mean eigenvalue, an estimate of the GGN's).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hessian_eigenthings import influence
from hessian_eigenthings._version import __version__
from hessian_eigenthings.cli import plots
from hessian_eigenthings.cli.influence_problem import (
    MAX_LENGTH,
    CharTokenizer,
    InfluenceProblem,
    builtin_influence_problem,
)
from hessian_eigenthings.cli.output import floats, guarded_run, json_default
from hessian_eigenthings.cli.problems import CLIError
from hessian_eigenthings.cli.run import resolve_device

__all__ = ["build_parser", "check_args", "main", "run"]

PROG = "hessian-eigenthings influence"
SIGN = (
    "score(q, z) = -grad L(q)^T (C + damping I)^-1 grad L(z): negative when up-weighting z "
    "lowers the query's loss (helpful), positive when it raises it (harmful)"
)


def _int_in(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {lo} to {hi}, got {text!r}"
            ) from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {value}")
        return value

    return parse


def _damping(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "The most influential training examples of a few queries: a tiny GPT-2 trained on "
            "generated sentences (character vocabulary, no download), its curvature fitted with "
            "hessian_eigenthings.influence, every query scored against every training sentence. "
            "Prints each query's most helpful and most harmful training sentences; writes "
            "influence.json and influence.png."
        ),
        epilog=f"Sign: {SIGN}.",
    )
    parser.add_argument(
        "--strategy",
        choices=("ekfac", "kfac", "ggn"),
        default="ekfac",
        help="the curvature C: EK-FAC, K-FAC (both inverted exactly) or the exact GGN (block CG; "
        "slower) (default: ekfac)",
    )
    parser.add_argument(
        "--damping",
        type=_damping,
        default=None,
        help="the damping, > 0 for --strategy ggn (default: 0.1 x the mean eigenvalue of the "
        "Kronecker-factored curvature, EK-FAC's for ggn)",
    )
    parser.add_argument(
        "--top-k",
        type=_int_in(1, 1000),
        default=5,
        help="training sentences shown per query and sign, at most --n-train (default: 5)",
    )
    parser.add_argument(
        "--queries",
        type=_int_in(1, 32),
        default=None,
        help="number of generated queries, one animal after another (default: 3)",
    )
    parser.add_argument(
        "--query",
        action="append",
        metavar="TEXT",
        default=None,
        help=f"a query of your own (lower-case letters, space and '.', 2 to {MAX_LENGTH} "
        "characters); repeat for several; replaces the generated queries",
    )
    parser.add_argument(
        "--n-train",
        type=_int_in(4, 4096),
        default=64,
        help="generated training sentences (default: 64)",
    )
    parser.add_argument(
        "--train-steps",
        type=_int_in(0, 100_000),
        default=200,
        help="Adam steps that train the model before it is scored; 0 scores it as initialised "
        "(default: 200)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the sentences, the model and the Monte-Carlo labels of the factors "
        "(default: 0)",
    )
    parser.add_argument(
        "-o",
        "--out",
        type=Path,
        default=Path("he_out"),
        help="folder for influence.json and influence.png (default: ./he_out)",
    )
    parser.add_argument(
        "--device", default="auto", help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (default: auto)"
    )
    parser.add_argument(
        "--threads",
        type=_int_in(1, 1024),
        default=1,
        help="CPU threads of torch for the run, restored after it; the model is tiny, so more "
        "threads mostly wait for each other (default: 1)",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show the progress bar of the scores",
    )
    progress.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never show it (default: only on a terminal)",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.top_k > args.n_train:
        parser.error(
            f"--top-k {args.top_k} is more than the {args.n_train} training sentences (--n-train)"
        )
    if args.strategy == "ggn" and args.damping == 0:
        parser.error("--strategy ggn needs --damping > 0 (the GGN is singular)")
    if args.query is not None and args.queries is not None:
        parser.error("--queries sets the number of generated queries; it cannot go with --query")
    tokenizer = CharTokenizer()
    for text in args.query or ():
        if not 2 <= len(text) <= MAX_LENGTH:
            parser.error(f"--query {text!r}: {len(text)} characters; a query has 2 to {MAX_LENGTH}")
        try:
            tokenizer.encode(text)
        except ValueError as exc:
            parser.error(f"--query {text!r}: {exc}")
    if args.query is None and args.queries is None:
        args.queries = 3


def _log(*parts: Any) -> None:
    print(*parts, flush=True)


def _fit(
    args: argparse.Namespace, problem: InfluenceProblem, task: influence.InfluenceTask
) -> tuple[influence.Influence, str, tuple[str, ...]]:
    """The fitted curvature, where its damping comes from, and the parameters left out."""
    if args.strategy != "ggn":
        fitted = influence.fit(
            problem.model,
            problem.train_data,
            task,
            curvature=args.strategy,
            damping=args.damping,
            seed=args.seed,
        )
        why = (
            "--damping"
            if args.damping is not None
            else f"0.1 x the mean eigenvalue of {args.strategy}"
        )
        return fitted, why, fitted.excluded_parameters
    # EK-FAC (two passes over the data, cheap beside the solves) gives the parameters the
    # Kronecker routes select, so that the strategies differ in the curvature only, and the
    # default damping
    ekfac = influence.fit(problem.model, problem.train_data, task, seed=args.seed)
    fitted = influence.fit(
        problem.model,
        problem.train_data,
        task,
        curvature="ggn",
        damping=ekfac.damping if args.damping is None else args.damping,
        param_filter=list(ekfac.layout.names),
        # measured on the built-in problem (2-core CPU, float64, tol 1e-8): 74 s with the
        # functional engine, 174 s with "auto", whose trials do not pay back in one short run
        engine="functional",
        seed=args.seed,
    )
    why = "--damping" if args.damping is not None else "0.1 x the mean eigenvalue of ekfac"
    return fitted, why, ekfac.excluded_parameters


def _left_out_summary(left_out: Sequence[str]) -> str:
    """``left out 12: 1 tied, 1 Embedding, 10 LayerNorm``, from ``fit``'s ``name (why)`` entries
    (the names go to the JSON)."""
    if not left_out:
        return "none left out"
    kinds: dict[str, int] = {}
    for entry in left_out:
        why = entry.partition(" (")[2].rstrip(")")
        kind = why.partition(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return f"left out {len(left_out)}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items())


def _table(
    problem: InfluenceProblem, top: influence.TopInfluences, q: int, scores: torch.Tensor
) -> str:
    lines = [f'query {q}: "{problem.query_texts[q]}"', "              score  train  text"]
    for label, idx in (("helpful", top.negative_indices), ("harmful", top.positive_indices)):
        for j, i in enumerate(idx[q].tolist()):
            lines.append(
                f"  {label if j == 0 else '':7s}  {float(scores[q, i]):+.4e}  {i:5d}  "
                f'"{problem.train_texts[i]}"'
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The subcommand's work (module docstring); returns the JSON document it wrote."""
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    device = resolve_device(args.device)
    try:
        import transformers
    except ImportError:
        raise CLIError(
            "the built-in model of 'influence' is a GPT-2 of transformers, which is not "
            "installed: pip install 'hessian-eigenthings[transformers]'"
        ) from None

    t = time.perf_counter()
    problem = builtin_influence_problem(
        n_train=args.n_train,
        n_queries=args.queries or 0,
        queries=args.query,
        seed=args.seed,
        train_steps=args.train_steps,
        device=device,
    )
    seconds["model"] = time.perf_counter() - t
    _log(
        f"model: {problem.description}, final training loss {problem.final_loss:.3f} per "
        f"character  [{seconds['model']:.1f} s]"
    )

    t = time.perf_counter()
    task = influence.causal_lm_task()
    fitted, why, left_out = _fit(args, problem, task)
    seconds["fit"] = time.perf_counter() - t
    excluded = _left_out_summary(left_out)
    _log(
        f"curvature: {args.strategy}"
        + (f" (fisher {fitted.fisher_type})" if fitted.fisher_type else "")
        + f", damping {fitted.damping:.4g} ({why}), {fitted.layout.size} scored parameters "
        f"({excluded})  [{seconds['fit']:.1f} s]"
    )

    t = time.perf_counter()
    scores = fitted.pairwise_scores(problem.query_data, problem.train_data, progress=args.progress)
    seconds["scores"] = time.perf_counter() - t
    n_query, n_train = scores.shape
    _log(
        f"scores: {n_query} quer{'ies' if n_query != 1 else 'y'} x {n_train} training sentences"
        f"  [{seconds['scores']:.1f} s]"
    )
    _log(f"sign: {SIGN}")
    top = influence.top_k(scores, args.top_k)
    for q in range(n_query):
        _log("")
        _log(_table(problem, top, q, scores))

    seconds["total"] = time.perf_counter() - start
    document: dict[str, Any] = {
        "version": __version__,
        "versions": {
            "hessian_eigenthings": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "damping_used": fitted.damping,
            "damping_source": why,
            "fisher_type": fitted.fisher_type,
            "device": str(device),
            "dtype": "float64",
            "torch_threads": torch.get_num_threads(),
        },
        "sign": SIGN,
        "model": {
            "description": problem.description,
            "num_parameters": sum(p.numel() for p in problem.model.parameters()),
            "scored_parameters": fitted.layout.size,
            "excluded_parameters": list(left_out),
            "final_training_loss": problem.final_loss,
        },
        "train": {
            "texts": problem.train_texts,
            "animals": problem.train_animals,
            "odd": problem.train_odd,
        },
        "queries": problem.query_texts,
        "scores": [floats(row) for row in scores],
        "top_k": {
            "k": args.top_k,
            "negative_indices": top.negative_indices.tolist(),
            "negative_scores": [floats(row) for row in top.negative_scores],
            "positive_indices": top.positive_indices.tolist(),
            "positive_scores": [floats(row) for row in top.positive_scores],
        },
        "seconds": seconds,
    }
    written = _write(args, document, problem, scores, top)
    # the total includes writing the files
    seconds["total"] = time.perf_counter() - start
    _log(f"\nwrote {', '.join(written)}  (total {seconds['total']:.1f} s)")
    return document


def _write(
    args: argparse.Namespace,
    document: dict[str, Any],
    problem: InfluenceProblem,
    scores: torch.Tensor,
    top: influence.TopInfluences,
) -> list[str]:
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--out: cannot create folder {str(out)!r}: {exc.strerror}") from None
    written = []
    png = out / "influence.png"
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "note: matplotlib is not installed, so no plot was written (influence.json is "
                "complete); install it with `pip install hessian-eigenthings[plotting]`",
                file=sys.stderr,
            )
        else:
            title = f"influence ({args.strategy}) of {problem.description}"
            fig = plots.influence_figure(
                scores,
                top,
                problem.query_texts,
                problem.train_animals,
                title,
                f"damping {document['settings']['damping_used']:.3g} · blue, negative: up-weighting "
                "the training example lowers the query's loss (helpful); red, positive: it raises "
                "it (harmful)",
            )
            plots.save(png, fig)
            written.append(str(png))
    path = out / "influence.json"
    with open(path, "w") as f:
        json.dump(document, f, indent=1, default=json_default)
    written.insert(0, str(path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``hessian-eigenthings influence [options]``; ``argv`` without the word ``influence``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return guarded_run(PROG, args.threads, lambda: run(args), CLIError)
