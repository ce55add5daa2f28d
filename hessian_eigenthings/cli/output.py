"""Where the results go (``-o``: a folder, a ``.json`` file, or ``-`` for stdout) and how
they are written: the JSON document and its number formatting."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["Destination", "floats", "json_default", "one_line_warning"]


def floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().to("cpu", torch.float64).tolist()]


class Destination:
    """Where ``-o`` sends the results: a folder, a ``.json`` file (plots beside it, named after
    it), or ``-`` (the JSON on stdout, no plot)."""

    def __init__(self, output: Path) -> None:
        self.to_stdout = str(output) == "-"
        if output.suffix.lower() == ".json" and not output.is_dir():
            self.folder, self.json, self.prefix = output.parent, output, output.stem + "."
        else:
            self.folder, self.json, self.prefix = output, output / "results.json", ""

    def png(self, name: str) -> Path:
        return self.folder / f"{self.prefix}{name}.png"


def json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """``warning: <message>`` on one line: the source line Python prints would be the command's
    own ``sys.exit(main())``, which says nothing to its user."""
    print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)
