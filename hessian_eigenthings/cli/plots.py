"""The figures the command writes: ``spectrum.png`` (the density with the computed
eigenvalues marked, and those by index), ``landscape.png``, and the ``influence`` subcommand's
``influence.png``. matplotlib is imported only here, when a figure is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hessian_eigenthings import _plot_style as style
from hessian_eigenthings.algorithms.result import EigenResult, SpectralDensityResult, TraceResult
from hessian_eigenthings.landscape import LandscapeResult

if TYPE_CHECKING:
    from hessian_eigenthings.influence import TopInfluences

__all__ = ["WHICH_WORDS", "influence_figure", "landscape_figure", "save", "spectrum_figure"]

WHICH_WORDS = {  # (heading, legend, eigenvectors): what --which selects, in each place's words
    "LA": ("top {k} eigenvalues, largest first", "top eigenvalues", "top"),
    "LM": ("{k} largest-magnitude eigenvalues", "largest |λ|", "largest-magnitude"),
    "SA": ("bottom {k} eigenvalues, smallest first", "bottom eigenvalues", "bottom"),
}


def spectrum_figure(
    eig: EigenResult | torch.Tensor,
    density: SpectralDensityResult | None,
    tr: TraceResult | None,
    which: str,
    title: str,
    notes: str,
    *,
    exact: bool = False,
) -> Any:
    """The summary figure: density with the computed eigenvalues marked, and those by index.

    ``eig``: the Lanczos result, or the eigenvalues themselves; ``exact``: they and the trace
    come from the operator's own eigendecomposition (Kronecker-factored operators)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(
        1,
        2 if density is not None else 1,
        figsize=(11 if density is not None else 6, 4.6),
        squeeze=False,
    )
    values = (
        (eig.eigenvalues if isinstance(eig, EigenResult) else eig)
        .detach()
        .to("cpu", torch.float64)
        .numpy()
    )
    solver = "eigh, exact" if exact else f"Lanczos --which {which}"
    heading, marker, _ = WHICH_WORDS[which]
    heading = heading.format(k=len(values))
    facts = [notes]
    if tr is not None:
        facts.append(
            f"trace = {tr.estimate:.4g} (exact)"
            if exact
            else f"trace ≈ {tr.estimate:.4g} ± {tr.stderr:.2g} (Hutch++)"
        )
    if which == "SA":
        facts.append(
            f"λ_min {'=' if exact else '≈'} {float(values[0]):.4g} ({'eigh' if exact else 'Lanczos'})"
        )
    elif density is not None:
        facts.append(f"λ_min ≈ {float(density.quadrature()[0].min()):.4g} (smallest SLQ node)")
    if density is not None:
        ax = axes[0, 0]
        density.plot(ax, color=style.MEASURED, lw=1.5, label="SLQ density")
        # many lines would cover the density: the most wanted few, light (all are in the right panel)
        marked = values[: style.MAX_MARKED_EIGENVALUES]
        label = (
            marker
            if len(marked) == len(values)
            else f"{marker} (first {len(marked)} of {len(values)})"
        )
        for j, v in enumerate(marked):
            ax.axvline(
                float(v), color=style.EIGEN, lw=0.8, alpha=0.45, label=label if j == 0 else None
            )
        style.finish(ax, loc="upper right")
    ax = axes[0, -1]
    idx = list(range(len(values)))  # from 0, as the printed table and EigenResult index them
    ax.plot(idx, values, "o-", color=style.EIGEN, ms=6 if len(values) <= 20 else 3.5)
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xlabel("index i (0: most wanted)")
    ax.set_ylabel("eigenvalue λᵢ")
    ax.set_title(f"{heading} ({solver})")
    # integer ticks, about ten of them: one per index runs together from k ~ 25 on
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
    ax.set_xlim(-0.5, len(values) - 0.5)
    style.finish(ax, legend=False)
    # long descriptions (a user's module path) wrap instead of running off the figure
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.text(0.5, 0.01, "   ·   ".join(facts), ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def landscape_figure(land: LandscapeResult) -> Any:
    """The loss along the eigenvectors; its title names the eigenvalues, as in Python."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    land.plot(ax)
    return fig


def influence_figure(
    scores: torch.Tensor,
    top: TopInfluences,
    query_texts: Sequence[str],
    groups: Sequence[str],
    title: str,
    notes: str,
) -> Any:
    """The scores ``(n_query, n_train)`` as a heat map, each row divided by its largest
    magnitude (queries' scores differ in scale by orders of magnitude), with each query's
    top-k helpful (most negative) and harmful (most positive) training examples marked;
    ``groups``: a label per training example, consecutive equal labels form a block on the
    axis (the built-in sentences' animals)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    S = scores.detach().to("cpu", torch.float64)
    n_query, n_train = S.shape
    scale = S.abs().amax(dim=1, keepdim=True)
    shown = (S / torch.where(scale > 0, scale, torch.ones_like(scale))).numpy()
    fig, ax = plt.subplots(figsize=(11, 1.9 + 0.42 * n_query), layout="constrained")
    image = ax.imshow(
        shown, aspect="auto", cmap="RdBu_r", vmin=-1.0, vmax=1.0, interpolation="nearest"
    )
    bar = fig.colorbar(image, ax=ax, pad=0.01)
    bar.set_label("score / largest |score| of the query", fontsize=8)
    neg, pos = top.negative_indices.cpu(), top.positive_indices.cpu()
    rows = torch.arange(n_query).unsqueeze(1)
    k = neg.shape[1]
    ax.scatter(
        neg.flatten().numpy(),
        rows.expand_as(neg).flatten().numpy(),
        marker="o",
        s=22,
        facecolors="none",
        edgecolors="black",
        linewidths=1.0,
    )
    ax.scatter(
        pos.flatten().numpy(),
        rows.expand_as(pos).flatten().numpy(),
        marker="x",
        s=22,
        color="black",
        linewidths=1.0,
    )
    ax.set_yticks(range(n_query))
    ax.set_yticklabels([f"{i}: {textwrap.shorten(t, 34)}" for i, t in enumerate(query_texts)])
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("training example (index as printed)")
    # blocks of equal consecutive labels: a line between blocks, the label over each block
    starts = [i for i in range(n_train) if i == 0 or groups[i] != groups[i - 1]]
    for i in starts[1:]:
        ax.axvline(i - 0.5, color=style.REFERENCE, lw=0.8)
    top_axis = ax.secondary_xaxis("top")
    ends = [*starts[1:], n_train]
    top_axis.set_xticks([(a + b - 1) / 2 for a, b in zip(starts, ends, strict=True)])
    top_axis.set_xticklabels([groups[a] for a in starts], fontsize=8)
    top_axis.tick_params(length=0)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    # the markers' legend in words, beside the notes: a legend box collides with the titles
    marks = f"○ top {k} helpful (most negative)   × top {k} harmful (most positive)"
    fig.supxlabel(textwrap.fill(f"{marks}   ·   {notes}", 170), fontsize=7)
    return fig


def save(path: Path, fig: Any) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
