"""One look for every figure the package draws (``spectrum.png``, loss landscapes, tracked
curvature): the colours, grid and legend of the command line's summary figure."""

from __future__ import annotations

from typing import Any

#: the measured quantity (density, loss, eigenvalues along training)
MEASURED = "C0"
#: eigenvalues, the trained point and the models built from them
EIGEN = "C3"
#: reference lines (zero, 2/lr, the quadratic model)
REFERENCE = "0.35"
LEGEND_FONTSIZE = 8
#: at most this many eigenvalues get a vertical line over a density: more hide it
MAX_MARKED_EIGENVALUES = 10


def finish(ax: Any, *, legend: bool = True, loc: str = "best") -> None:
    """Grid and (when anything is labelled) a small legend, as in ``spectrum.png``."""
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc, fontsize=LEGEND_FONTSIZE)
