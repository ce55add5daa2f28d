"""Where the results go (``-o``: a folder, a ``.json`` file, or ``-`` for stdout) and how
they are written: the JSON document and its number formatting."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["Destination", "floats", "guarded_run", "json_default", "one_line_warning"]


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


def guarded_run(
    prog: str, threads: int | None, work: Callable[[], object], expected: type[Exception]
) -> int:
    """A command's body as its exit status: ``work()`` with each warning on one line, ``threads``
    torch threads (``None``: as they are), and the caller's warning printer and thread count back
    after; ``expected`` (the command's own error) one ``prog: error:`` line, status 2; an
    interrupt one line, status 130."""
    before = torch.get_num_threads()
    # catch_warnings gives an in-process caller its own showwarning (and filters, untouched
    # here) back on the way out
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warning
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            work()
        except expected as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        finally:
            torch.set_num_threads(before)  # an in-process caller keeps its own setting
    return 0
