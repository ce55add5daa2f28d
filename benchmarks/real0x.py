"""The legacy corpus (``compat/``) through real 0.x and through the facade, side by side.

    python -m benchmarks.real0x --real-0x /path/to/0x-checkout                 # CPU
    python -m benchmarks.real0x --real-0x /path/to/0x-checkout --device cuda   # GPU
    python -m benchmarks.bench_facade --real-0x /path/to/0x-checkout [...]     # the same

0.x is not on the package registry; take its source from the upstream
repository's history (e.g. commit 605915a, the last 0.x state) into a
directory outside this repository, or into its git-ignored ``.real0x/``
folder (``git archive 605915a | tar -x -C .real0x``; never committed), which
is how it travels to a GPU machine that gets a copy of the working tree.
It has the same import name as this package, so each implementation runs in
its own worker process, whose ``PYTHONPATH`` holds only its package root;
each worker reports the file it imported, and the run stops if it is not the
expected one.

Each script runs exactly as its author wrote it (``runpy``, as
``__main__``; its output discarded, warnings ignored): models built on the
CPU, ``use_gpu`` as written. ``--device cpu`` hides CUDA from both workers
(scripts that leave ``use_gpu=True`` crash on 0.x there: reported as such);
``--device cuda`` leaves CUDA visible, and both move the model where the
script asks. Workers: ``facade``, ``0x`` and ``facade-aa`` (a second facade
worker: the A/A control, whose ratio to ``facade`` shows the noise). After
``--warmup`` runs each, repeats are interleaved (facade, 0x, aa, then aa, 0x,
facade, ...); a run's time is the wall time of the whole script (model and
data construction included, imports excluded: each worker imported
everything once), with ``torch.cuda.synchronize()`` on both sides of it on
a GPU. The ratio is the facade's median over 0.x's.

Results: the eigenvalues each script leaves in its globals (``eigenvals``,
``eigs``, ``eigenval``, ``lanczos_vals``), compared sorted; the largest
relative difference to 0.x is reported with the tolerance that applies
(1e-4 for Lanczos, power iteration's own tolerance otherwise).

Writes ``real0x.json`` and ``real0x.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "compat"
RESULT_NAMES = ("eigenvals", "eigs", "eigenval", "lanczos_vals")
# relative agreement asked of each script's eigenvalues (Lanczos: 1e-4; power iteration: its
# threshold decides, and differing start vectors move the result within it)
TOLERANCE = {
    "cnn_lanczos.py": 1e-4,
    "fp16_hvp.py": 1e-2,  # float16 vectors: rounding at 1e-3, through deflation
    "lanczos_microbatch.py": 1e-4,
    "lanczos_smallest.py": 1e-4,
    "readme_cnn_default_gpu.py": 1e-3,
}
DEFAULT_TOLERANCE = 1e-3


# -- worker (runs in its own process; imports nothing from this repository) --------------------


def _flat_values(g: dict[str, Any]) -> dict[str, list[float]]:
    import numpy as np

    out: dict[str, list[float]] = {}
    for name in RESULT_NAMES:
        if name in g:
            value = g[name]
            if hasattr(value, "detach"):
                value = value.detach().cpu().numpy()
            out[name] = np.asarray(value, dtype=np.float64).reshape(-1).tolist()
    return out


def _worker(script: Path, threads: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    import hessian_eigenthings

    cuda = torch.cuda.is_available()
    print(json.dumps({"package": hessian_eigenthings.__file__, "cuda": cuda}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        reply: dict[str, Any]
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")  # each run is a fresh __main__: keep stderr clean
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                g = runpy.run_path(str(script), run_name="__main__")
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            reply = {"ok": True, "seconds": seconds, "values": _flat_values(g)}
        except BaseException as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(reply), flush=True)


# -- parent --------------------------------------------------------------------------------------


class Worker:
    def __init__(
        self, name: str, package_root: Path, script: Path, device: str, threads: int
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
        env["PYTHONPATH"] = str(package_root)
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.name = name
        # run this file by path: its folder, not the repository root, is sys.path[0], so
        # the worker imports only the package under package_root
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                str(script),
                "--threads",
                str(threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=script.parent,
        )
        hello = self._read()
        self.package = hello["package"]
        if not Path(self.package).resolve().is_relative_to(package_root.resolve()):
            self.close()
            raise RuntimeError(
                f"{name} worker imported {self.package}, not the package under {package_root}"
            )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (status {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _max_rel_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float | None:
    diffs = []
    for name in set(a) & set(b):
        x, y = sorted(a[name]), sorted(b[name])
        if len(x) != len(y):
            return float("inf")
        scale = max((abs(v) for v in y), default=0.0) or 1.0
        diffs += [abs(p - q) / max(abs(q), 1e-3 * scale) for p, q in zip(x, y, strict=True)]
    return max(diffs) if diffs else None


def run_script(
    script: Path, real0x: Path, device: str, repeats: int, warmup: int, threads: int
) -> dict[str, Any]:
    roles = {"facade": ROOT, "0x": real0x, "facade-aa": ROOT}
    workers = {name: Worker(name, root, script, device, threads) for name, root in roles.items()}
    times: dict[str, list[float]] = {name: [] for name in roles}
    last: dict[str, dict[str, Any]] = {}
    try:
        for _ in range(warmup):
            for name, w in workers.items():
                last[name] = w.run()
        order = list(roles)
        for rep in range(repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                if not last.get(name, {"ok": True})["ok"]:
                    continue  # it crashed in the warm-up: it will crash again
                reply = workers[name].run()
                last[name] = reply
                if reply["ok"]:
                    times[name].append(reply["seconds"])
    finally:
        for w in workers.values():
            w.close()
    row: dict[str, Any] = {
        "script": script.name,
        "packages": {n: w.package for n, w in workers.items()},
    }
    for name in roles:
        row[name] = {
            "ok": last[name]["ok"],
            "median_s": statistics.median(times[name]) if times[name] else None,
            "times_s": times[name],
            "error": last[name].get("error"),
            "values": last[name].get("values"),
        }
    f, z, aa = row["facade"]["median_s"], row["0x"]["median_s"], row["facade-aa"]["median_s"]
    row["ratio_facade_over_0x"] = f / z if f and z else None
    row["ratio_aa"] = f / aa if f and aa else None
    tol = TOLERANCE.get(script.name, DEFAULT_TOLERANCE)
    diff = (
        _max_rel_diff(row["facade"]["values"], row["0x"]["values"])
        if row["facade"]["ok"] and row["0x"]["ok"]
        else None
    )
    row["max_rel_diff"], row["tolerance"] = diff, tol
    row["agrees"] = None if diff is None else diff <= tol
    return row


def to_markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [
        f"Legacy corpus: real 0.x ({doc['real0x']}) vs the facade, device {doc['device']} "
        f"({env['gpu'] or env['cpu']}), torch {env['torch']}, {env['threads']} thread(s); median of "
        f"{doc['repeats']} interleaved repeats after {doc['warmup']} warm-up(s).",
        "",
        "| script | 0.x (s) | facade (s) | facade / 0.x | A/A | max rel. diff (tol) | note |",
        "|---|---|---|---|---|---|---|",
    ]

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    def r(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for row in doc["rows"]:
        note = ""
        if not row["0x"]["ok"]:
            note = f"0.x crashed: {row['0x']['error']}"
        if not row["facade"]["ok"]:
            note = f"facade failed: {row['facade']['error']}"
        diff = (
            "-"
            if row["max_rel_diff"] is None
            else f"{row['max_rel_diff']:.1e} ({row['tolerance']:.0e})"
        )
        lines.append(
            f"| {row['script']} | {s(row['0x']['median_s'])} | {s(row['facade']['median_s'])} | "
            f"{r(row['ratio_facade_over_0x'])} | {r(row['ratio_aa'])} | {diff} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--real-0x",
        type=Path,
        required=True,
        help="root of a 0.x checkout (holds hessian_eigenthings/)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per worker (0: torch's default)"
    )
    p.add_argument("--only", nargs="*", help="script names (default: the whole corpus)")
    p.add_argument("--out", type=Path, default=Path("bench_out/real0x"))
    args = p.parse_args(argv)

    real0x = args.real_0x.resolve()
    if not (real0x / "hessian_eigenthings" / "__init__.py").is_file():
        p.error(f"--real-0x {real0x} holds no hessian_eigenthings/__init__.py")
    if real0x == ROOT:
        p.error("--real-0x is this repository: give the root of a 0.x checkout")
    if real0x.is_relative_to(ROOT) and real0x.relative_to(ROOT).parts[0] != ".real0x":
        p.error(
            "--real-0x must lie outside this repository, or in its git-ignored .real0x/ folder "
            "(0.x is never added to it)"
        )
    scripts = sorted(CORPUS.glob("*.py"))
    if args.only:
        scripts = [s for s in scripts if s.name in args.only or s.stem in args.only]

    import torch

    rows = []
    for script in scripts:
        row = run_script(script, real0x, args.device, args.repeats, args.warmup, args.threads)
        rows.append(row)
        print(
            f"{script.name}: 0.x {row['0x']['median_s']}, facade {row['facade']['median_s']}, "
            f"ratio {row['ratio_facade_over_0x']}, A/A {row['ratio_aa']}, diff {row['max_rel_diff']}",
            flush=True,
        )
    gpu = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda" and torch.cuda.is_available()
        else None
    )
    doc = {
        "command": "python -m benchmarks.real0x "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "real0x": str(real0x),
        "device": args.device,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "gpu": gpu,
            "threads": args.threads or torch.get_num_threads(),
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real0x.json").write_text(json.dumps(doc, indent=1))
    md = to_markdown(doc)
    (args.out / "real0x.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    else:
        sys.exit(main())
