"""The command-line tool end to end (subprocesses) and its option handling (in process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings import cli

REPO = Path(__file__).resolve().parents[1]

# A user's model file as the --model contract describes it: make() -> (model, dataloader, criterion).
USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make():
        gen = torch.Generator().manual_seed(123)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        x = torch.randn(40, 6, generator=gen)
        y = torch.randint(0, 3, (40,), generator=gen)
        data = [(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:], y[32:])]
        return model, data, nn.CrossEntropyLoss()

    def not_a_triple():
        return 1, 2

    def criterion_class():
        model, data, _ = make()
        return model, data, nn.CrossEntropyLoss

    NOT_CALLABLE = 3
    """
)

SMALL = [
    "-k",
    "3",
    "--trace-matvecs",
    "9",
    "--slq-runs",
    "2",
    "--slq-steps",
    "12",
    "--grid-points",
    "300",
]


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_user_model.py"
    path.write_text(USER_MODULE)
    return path


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "hessian_eigenthings", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _load(path: Path):  # the user's make() loaded the way the test compares against
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["make"]()  # type: ignore[operator]


def test_user_model_file_matches_library(tmp_path: Path, user_module: Path) -> None:
    out = tmp_path / "out"
    proc = _run_cli(
        [
            "--model",
            f"{user_module}:make",
            "--dtype",
            "float64",
            "--seed",
            "7",
            "-o",
            str(out),
            *SMALL,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "top 3 eigenvalues" in proc.stdout
    assert "memory estimate" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    eigen = res["eigenvalues"]
    # the rule behind `converged`: residual <= max(tol·|λ|, residual_floor), the floor's pairs flagged
    assert eigen["tol"] > 0 and eigen["residual_floor"] > 0
    for r, v, c, by_floor in zip(
        eigen["residuals"],
        eigen["values"],
        eigen["converged"],
        eigen["converged_by_floor"],
        strict=True,
    ):
        assert c == (r <= max(eigen["tol"] * abs(v), eigen["residual_floor"]))
        assert by_floor == (c and r > eigen["tol"] * abs(v))

    model, data, criterion = _load(user_module)
    model = model.double()
    data = [(x.double(), y) for x, y in data]
    op = he.HessianOperator(model, data, he.supervised_loss(criterion))
    eig = he.lanczos(op, k=3, which="LA", tol=1e-4, seed=7)
    tr = he.trace(op, num_matvecs=9, seed=7)
    sd = he.spectral_density(op, num_runs=2, lanczos_steps=12, num_grid_points=300, seed=7)

    torch.testing.assert_close(
        torch.tensor(res["eigenvalues"]["values"], dtype=torch.float64),
        eig.eigenvalues,
        rtol=1e-9,
        atol=1e-12,
    )
    assert res["trace"]["estimate"] == pytest.approx(tr.estimate, rel=1e-9)
    torch.testing.assert_close(
        torch.tensor(res["spectral_density"]["nodes"], dtype=torch.float64),
        sd.quadrature()[0],
        rtol=1e-9,
        atol=1e-12,
    )
    torch.testing.assert_close(
        torch.tensor(res["spectral_density"]["density"], dtype=torch.float64),
        sd.density,
        rtol=1e-7,
        atol=1e-9,
    )
    assert res["model"]["num_parameters"] == op.size == 6 * 8 + 8 + 8 * 3 + 3
    assert res["memory_estimate"]["parameter_bytes"] == op.size * 8

    png = out / "spectrum.png"
    assert png.is_file() and png.stat().st_size > 20_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_builtin_default_small(tmp_path: Path) -> None:
    """The built-in problem (synthetic data here, for speed) with every stage on."""
    proc = _run_cli(
        ["--synthetic", "--train-steps", "5", "--seed", "1", "--no-progress", *SMALL], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "he_out"  # the default output folder, relative to the working directory
    res = json.loads((out / "results.json").read_text())
    assert set(res) >= {
        "config",
        "model",
        "eigenvalues",
        "trace",
        "spectral_density",
        "memory_estimate",
        "timings_s",
    }
    assert "synthetic" in res["model"]["description"]

    problem = cli.builtin_problem(seed=1, train_steps=5, synthetic=True)
    op = cli.build_operator(problem, "hessian")
    eig = he.lanczos(op, k=3, which="LA", tol=1e-4, seed=1)
    torch.testing.assert_close(
        torch.tensor(res["eigenvalues"]["values"], dtype=torch.float64),
        eig.eigenvalues,
        rtol=1e-4,
        atol=1e-6,
    )
    assert (out / "spectrum.png").stat().st_size > 20_000


def test_module_function_form_and_ggn(tmp_path: Path, user_module: Path) -> None:
    proc = _run_cli(
        ["--model", "tiny_user_model:make", "--operator", "ggn", "--no-plot", "-o", "res", *SMALL],
        cwd=user_module.parent,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads((user_module.parent / "res" / "results.json").read_text())
    assert not (user_module.parent / "res" / "spectrum.png").exists()
    # the GGN of a convex loss is positive semi-definite
    assert min(res["eigenvalues"]["values"]) > 0
    assert res["trace"]["estimate"] > 0


def test_fisher_and_finite_difference_in_process(tmp_path: Path, user_module: Path) -> None:
    for extra in (["--operator", "fisher"], ["--method", "finite_difference"]):
        code = cli.main(
            [
                "--model",
                f"{user_module}:make",
                "-q",
                "--no-plot",
                "-o",
                str(tmp_path / extra[1]),
                *SMALL,
                *extra,
            ]
        )
        assert code == 0
        res = json.loads((tmp_path / extra[1] / "results.json").read_text())
        assert len(res["eigenvalues"]["values"]) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-k", "0"], "expected a positive integer"),
        (["--operator", "laplacian"], "invalid choice"),
        (
            ["--operator", "ggn", "--method", "finite_difference"],
            "applies to --operator hessian only",
        ),
        (["--trace-matvecs", "2"], "must be 0 (skip) or >= 3"),
        (["--dtype", "float8"], "invalid choice"),
        (["--model", "x:y", "--synthetic"], "cannot be combined"),
    ],
)
def test_bad_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "expects MODULE:FUNCTION"),
        ("{dir}/missing.py:make", "not found"),
        ("{file}:nothing", "has no attribute 'nothing'"),
        ("{file}:NOT_CALLABLE", "is not callable"),
        ("{file}:not_a_triple", "must return (model, dataloader, criterion)"),
        ("surely_no_such_module_xyz:make", "no module named"),
        ("{file}:criterion_class", "pass an instance: nn.CrossEntropyLoss()"),
    ],
)
def test_bad_user_model(
    spec: str, message: str, user_module: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec.format(dir=tmp_path, file=user_module)
    code = cli.main(["--model", spec, "-o", str(tmp_path / "out"), *SMALL])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("hessian-eigenthings: error:") and message in err


def test_bad_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli.main(["--device", "nonsense", "-o", str(tmp_path)])
    assert code == 2
    assert "unknown device" in capsys.readouterr().err


def test_without_matplotlib_still_writes_json(
    tmp_path: Path,
    user_module: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(
        sys.modules, "matplotlib", None
    )  # makes `import matplotlib` raise ImportError
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "-o",
            str(tmp_path),
            "-k",
            "2",
            "--trace-matvecs",
            "0",
            "--slq-runs",
            "0",
        ]
    )
    assert code == 0
    assert (tmp_path / "results.json").is_file()
    assert not (tmp_path / "spectrum.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_help_documents_the_model_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(model, dataloader, criterion)" in text and "./he_out" in text


def test_builtin_problem_is_deterministic() -> None:
    a = cli.builtin_problem(seed=3, train_steps=3, synthetic=True)
    b = cli.builtin_problem(seed=3, train_steps=3, synthetic=True)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert isinstance(a.model, nn.Module) and len(list(a.dataloader)) == 1


def test_k_larger_than_operator_is_rejected(
    user_module: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the library rejects k > n; the CLI used to lower k to n silently and run a huge budget
    n = 6 * 8 + 8 + 8 * 3 + 3
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "-o",
            str(tmp_path / "out"),
            *SMALL[2:],
            "-k",
            str(n + 1),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"k must be between 1 and the operator size n = {n}" in err and "eigvalsh" in err
    assert not (tmp_path / "out").exists()


BAD_USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def _data():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(8, 3, generator=gen), torch.randint(0, 2, (8,), generator=gen)

    def unreduced():
        x, y = _data()
        return nn.Linear(3, 2), [(x, y)], nn.CrossEntropyLoss(reduction="none")

    def unreduced_function():
        x, y = _data()
        return nn.Linear(3, 2), [(x, y)], lambda out, t: (out - torch.nn.functional.one_hot(t, 2)).pow(2).sum(1)

    def dicts():
        x, y = _data()
        return nn.Linear(3, 2), [{"x": x, "y": y}], nn.CrossEntropyLoss()

    def needs_args(width, depth=2):
        raise AssertionError("must not be called")
    """
)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("unreduced", "reduction='none'"),
        ("unreduced_function", "must return a scalar loss"),
        ("dicts", "need the Python API"),
        ("needs_args", "needs arguments"),
    ],
)
def test_user_model_errors_are_one_line(fn: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad_user_model.py"
    path.write_text(BAD_USER_MODULE)
    proc = _run_cli(["--model", f"{path}:{fn}", "--no-plot", "-o", "out", *SMALL], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hessian-eigenthings: error:"), proc.stderr
    assert message in lines[0]


def test_run_sh_resolves_paths_where_the_user_stands(tmp_path: Path, user_module: Path) -> None:
    # a checkout whose set-up is already done: stub setup.sh, a .venv python that is this one
    repo = tmp_path / "checkout"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "run.sh").write_text((REPO / "scripts" / "run.sh").read_text())
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    venv_python.chmod(0o755)
    proj = user_module.parent / "proj"
    proj.mkdir()
    (proj / "cnn_problem.py").write_text(user_module.read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            "bash",
            str(repo / "scripts" / "run.sh"),
            "--model",
            "cnn_problem.py:make",
            "--no-plot",
            "-o",
            "out",
            *SMALL,
        ],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (proj / "out" / "results.json").is_file()
    assert not (repo / "out").exists()


def test_setup_sh_reports_progress_and_no_pip_error(tmp_path: Path) -> None:
    # setup.sh against a recording stand-in for python/pip: what it runs and prints, no network
    repo = tmp_path / "checkout"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "setup.sh").write_text((REPO / "scripts" / "setup.sh").read_text())
    (repo / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    log = tmp_path / "pip.log"
    recorder = (
        "#!/bin/sh\n"
        f'echo "$*" >> "{log}"\n'
        'if [ "$3" = "check" ]; then\n'
        '  echo "curvlinops-for-pytorch 3.0.1 requires backpack-for-pytorch, which is not installed."\n'
        "  exit 1\n"
        "fi\n"
    )
    fake = tmp_path / "fakepython"
    fake.write_text(
        "#!/bin/sh\n"
        'mkdir -p "$3/bin"\n'
        f"cat > \"$3/bin/python\" <<'REC'\n{recorder}REC\n"
        'chmod +x "$3/bin/python"\n'
    )
    fake.chmod(0o755)
    first = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=repo,
        env={**os.environ, "PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert first.returncode == 0, first.stderr
    assert "ERROR" not in first.stdout + first.stderr
    assert "[1/5]" in first.stderr and "[5/5]" in first.stderr and "setup: done" in first.stderr
    installs = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert installs and all("--no-warn-conflicts" in line for line in installs)
    assert any("--no-deps curvlinops-for-pytorch" in line for line in installs)
    second = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=repo,
        env={**os.environ, "PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 0 and second.stderr == ""  # stamp present: nothing to do, silent


def test_quiet_num_batches_and_memory_line(
    tmp_path: Path, user_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q"
    assert (
        cli.main(["--model", f"{user_module}:make", "-q", "--no-plot", "-o", str(out), *SMALL]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"wrote {out / 'results.json'}"
    )  # -q keeps the paths

    # the user's data: batches of 16, 16 and 8 samples; --num-batches 2 reads 32 of them
    assert (
        cli.main(
            [
                "--model",
                f"{user_module}:make",
                "--operator",
                "ggn",
                "--num-batches",
                "2",
                "--no-plot",
                "--no-progress",
                "-o",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "data per product: 32 samples in 2 batches (--num-batches 2)" in text
    assert json.loads((out / "results.json").read_text())["data"] == {"samples": 32, "batches": 2}
    memory_line = next(line for line in text.splitlines() if line.startswith("memory estimate"))
    assert "(ggn, Jacobian products," in memory_line and "autograd" not in memory_line
    assert (
        cli.main(
            [
                "--model",
                f"{user_module}:make",
                "--operator",
                "fisher",
                "--no-plot",
                "--no-progress",
                "-o",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "data per product: 40 samples in 3 batches\n" in text
    assert "memory estimate (fisher, per-sample gradients," in text


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_figure_says_what_it_shows(which: str) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    A = torch.diag(torch.linspace(-1.0, 2.0, 60, dtype=torch.float64))
    op = he.LambdaOperator(lambda v: A @ v, 60, dtype=torch.float64)
    eig = he.lanczos(op, k=3, which=which, seed=0)
    density = he.spectral_density(op, num_runs=2, lanczos_steps=20, num_grid_points=200, seed=0)
    tr = he.trace(op, num_matvecs=9, seed=0)
    title = (
        "empirical Fisher of "
        + "a/very/long/path/to/some_users_experiment_module.py:make_problem " * 3
    )
    fig = cli.plots.spectrum_figure(
        eig, density, tr, which, title, "data: 32 samples in 2 batches, float64 on cpu"
    )
    try:
        fig.canvas.draw()
        texts = [t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
        joined = " ".join(" ".join(texts).split())
        assert joined.count("empirical Fisher") == 1 and "make_problem" in joined
        assert ("bottom 3 eigenvalues" if which == "SA" else "top 3 eigenvalues") in joined
        assert "top" not in joined if which == "SA" else "bottom" not in joined
        assert f"trace ≈ {tr.estimate:.4g}" in joined
        lam_min = re.search(r"λ_min ≈ (\S+)", joined)
        assert lam_min is not None and float(lam_min.group(1)) == pytest.approx(-1.0, abs=1e-2)
        assert "32 samples in 2 batches, float64" in joined and "σ =" in joined
        # nothing runs off the figure: every text lies inside the canvas
        renderer = fig.canvas.get_renderer()
        width, height = fig.canvas.get_width_height()
        for t in [*fig.texts, *(ax.title for ax in fig.axes)]:
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (
                t.get_text()
            )
    finally:
        plt.close(fig)


def test_progress_lines_off_a_terminal(
    tmp_path: Path,
    user_module: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hessian_eigenthings.algorithms import _common

    monkeypatch.setattr(
        _common, "LOG_INTERVAL_S", 0.0
    )  # a long run, compressed: every update is due
    assert (
        cli.main(["--model", f"{user_module}:make", "--no-plot", "-o", str(tmp_path), *SMALL]) == 0
    )
    err = capsys.readouterr().err
    for stage in ("lanczos (k=3): ", "hutch++: ", "spectral density: "):
        assert stage in err, err
    assert "\r" not in err
    assert (
        cli.main(
            [
                "--model",
                f"{user_module}:make",
                "--no-plot",
                "--no-progress",
                "-o",
                str(tmp_path),
                *SMALL,
            ]
        )
        == 0
    )
    assert capsys.readouterr().err == ""


def test_landscape_along_the_top_eigenvectors(tmp_path: Path, user_module: Path) -> None:
    """--landscape 2d: the grid of losses in results.json equals the library's loss_landscape
    along the eigenvectors of the library's own Lanczos run, and landscape.png is written."""
    out = tmp_path / "out"
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "-q",
            "-o",
            str(out),
            "-k",
            "2",
            "--trace-matvecs",
            "0",
            "--slq-runs",
            "0",
            "--landscape",
            "2d",
            "--landscape-steps",
            "3",
            "--landscape-span",
            "0.5",
        ]
    )
    assert code == 0
    saved = json.loads((out / "results.json").read_text())["landscape"]
    assert (out / "landscape.png").stat().st_size > 1000
    model, data, criterion = _load(user_module)
    op = he.HessianOperator(model, data, he.supervised_loss(criterion))
    eig = he.algorithms.lanczos(op, k=2, which="LA", tol=1e-4, seed=0)
    ref = he.loss_landscape(
        model, data, he.supervised_loss(criterion), directions=eig, dims=2, span=0.5, steps=3
    )
    np.testing.assert_allclose(np.array(saved["losses"]), ref.losses.numpy(), rtol=1e-5)
    assert saved["center_loss"] == pytest.approx(ref.center_loss, rel=1e-6)
    assert (
        cli.main(
            [
                "--model",
                f"{user_module}:make",
                "-q",
                "--no-plot",
                "-o",
                str(out),
                "-k",
                "1",
                "--trace-matvecs",
                "0",
                "--slq-runs",
                "0",
                "--landscape",
                "2d",
            ]
        )
        == 2
    )


@pytest.mark.parametrize("operator", ["kfac", "ekfac", "kfoc"])
def test_kronecker_factored_operators_from_the_command_line(
    tmp_path: Path, user_module: Path, operator: str
) -> None:
    # factored registry rows: the CLI builds them (type-2) and runs the algorithms on them
    out = tmp_path / operator
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "--dtype",
            "float64",
            "--operator",
            operator,
            "-q",
            "--no-plot",
            "-o",
            str(out),
            *SMALL,
        ]
    )
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    model, data, criterion = _load(user_module)
    model = model.double()
    data = [(x.double(), y) for x, y in data]
    cls = {"kfac": he.KFACOperator, "ekfac": he.EKFACOperator, "kfoc": he.KFOCOperator}[operator]
    op = cls(model, data, he.supervised_forward, he.supervised_loss_of_output(criterion))
    top = torch.linalg.eigvalsh(op.to_dense()).flip(0)[:3]
    torch.testing.assert_close(
        torch.tensor(res["eigenvalues"]["values"], dtype=torch.float64), top, rtol=1e-6, atol=1e-10
    )
    assert (
        res["memory_estimate"]["method"]
        == he.operators.registry.curvature(operator).memory[0].label
    )


def test_figure_with_many_eigenvalues_stays_readable() -> None:
    """-k 50: the index axis keeps a readable number of ticks, and the density panel marks
    only a few eigenvalues, in a light colour, so that the density stays visible."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    A = torch.diag(torch.linspace(-1.0, 2.0, 120, dtype=torch.float64))
    op = he.LambdaOperator(lambda v: A @ v, 120, dtype=torch.float64)
    eig = he.lanczos(op, k=50, which="SA", seed=0)
    density = he.spectral_density(op, num_runs=2, lanczos_steps=20, num_grid_points=200, seed=0)
    fig = cli.plots.spectrum_figure(eig, density, None, "SA", "Hessian of a diagonal", "data: none")
    try:
        fig.canvas.draw()
        left, right = fig.axes[0], fig.axes[-1]
        labels = [t.get_text() for t in right.get_xticklabels() if t.get_text()]
        assert 2 <= len(labels) <= 12, labels
        marks = [
            line
            for line in left.get_lines()
            if len(set(np.asarray(line.get_xdata(), dtype=float))) == 1
        ]
        assert 1 <= len(marks) <= 10
        assert all((line.get_alpha() or 1.0) <= 0.5 for line in marks)
        assert "10 of 50" in " ".join(t.get_text() for t in left.get_legend().get_texts())
    finally:
        plt.close(fig)


def test_method_help_says_each_method_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--operator hessian: autograd (default) or finite_difference" in text
    assert text.count("finite_difference") == 3  # usage, the option's choices and its help, once


def test_output_json_file_and_stdout(
    tmp_path: Path,
    user_module: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    quick = [
        "--model",
        f"{user_module}:make",
        "-k",
        "2",
        "--trace-matvecs",
        "0",
        "--slq-runs",
        "0",
        "--no-progress",
    ]
    path = tmp_path / "runs" / "run1.json"
    assert cli.main([*quick, "-o", str(path)]) == 0
    assert path.is_file() and not (path / "results.json").exists()
    saved = json.loads(path.read_text())
    assert len(saved["eigenvalues"]["values"]) == 2
    assert (tmp_path / "runs" / "run1.spectrum.png").is_file()  # the plot beside it, named after it
    capsys.readouterr()
    assert cli.main([*quick, "-o", "-"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)  # stdout holds the JSON document and nothing else
    np.testing.assert_allclose(
        printed["eigenvalues"]["values"], saved["eigenvalues"]["values"], rtol=1e-5
    )
    assert "top 2 eigenvalues" in err
    assert not (tmp_path / "he_out").exists()  # nothing written to the default folder


def test_bottom_eigenvectors_are_called_bottom(
    tmp_path: Path,
    user_module: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    figures: list = []
    monkeypatch.setattr(cli.plots, "save", lambda path, fig: figures.append((path.name, fig)))
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "-o",
            str(tmp_path),
            "-k",
            "2",
            "--which",
            "SA",
            "--trace-matvecs",
            "0",
            "--slq-runs",
            "0",
            "--no-progress",
            "--landscape",
            "2d",
        ]
    )
    assert code == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("loss landscape"))
    assert "bottom eigenvectors" in line and "top" not in line
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["landscape"]["alphas"]) == 21  # the 2-D default grid: 21 x 21 points
    fig = dict(figures)["landscape.png"]
    title = fig.axes[0].get_title()
    values = saved["eigenvalues"]["values"]
    assert "top" not in title and f"{values[0]:.3g}" in title and f"{values[1]:.3g}" in title


def test_threads_option(
    tmp_path: Path, user_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = torch.get_num_threads()
    quick = [
        "--model",
        f"{user_module}:make",
        "-k",
        "2",
        "--trace-matvecs",
        "0",
        "--slq-runs",
        "0",
        "--no-plot",
    ]
    assert cli.main([*quick, "-q", "-o", str(tmp_path), "--threads", "1"]) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["torch_threads"] == 1
    assert torch.get_num_threads() == before  # an in-process run gives the setting back
    assert cli.main([*quick, "-q", "-o", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["torch_threads"] == before
    with pytest.raises(SystemExit):
        cli.main([*quick, "--threads", "0"])
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("operator", ["kfac", "ekfac", "kfoc"])
def test_kronecker_factored_operators_use_their_exact_eigh_and_trace(
    tmp_path: Path, user_module: Path, operator: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        [
            "--model",
            f"{user_module}:make",
            "--dtype",
            "float64",
            "--operator",
            operator,
            "--no-plot",
            "--no-progress",
            "-o",
            str(tmp_path),
            "-k",
            "3",
            "--trace-matvecs",
            "9",
            "--slq-runs",
            "0",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    model, data, criterion = _load(user_module)
    model = model.double()
    data = [(x.double(), y) for x, y in data]
    cls = {"kfac": he.KFACOperator, "ekfac": he.EKFACOperator, "kfoc": he.KFOCOperator}[operator]
    op = cls(model, data, he.supervised_forward, he.supervised_loss_of_output(criterion))
    dense = op.to_dense()
    top = torch.linalg.eigvalsh(dense).flip(0)[:3]
    torch.testing.assert_close(
        torch.tensor(res["eigenvalues"]["values"], dtype=torch.float64), top, rtol=1e-10, atol=1e-13
    )
    assert res["eigenvalues"]["method"] == "eigh" and res["eigenvalues"]["matvecs"] == 0
    assert res["trace"]["method"] == "exact" and res["trace"]["matvecs"] == 0
    assert res["trace"]["estimate"] == pytest.approx(float(dense.trace()), rel=1e-10)
    assert res["total_matvecs"] == 0
    assert "exact eigendecomposition" in text and "trace (exact" in text


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_kronecker_factored_landscape_uses_exact_eigenvectors(
    tmp_path: Path, user_module: Path, which: str
) -> None:
    """--operator kfac --landscape: the directions are the factors' exact eigenvectors (no
    product at all), each an eigenvector of the dense operator for the reported eigenvalue."""
    args = ["--model", f"{user_module}:make", "--dtype", "float64", "--operator", "kfac", "-q"]
    args += ["--no-plot", "-o", str(tmp_path), "-k", "2", "--which", which, "--trace-matvecs", "0"]
    args += ["--slq-runs", "0", "--landscape", "2d", "--landscape-steps", "3"]
    assert cli.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["eigenvectors"] == {"method": "eigh", "matvecs": 0} and res["total_matvecs"] == 0
    model, data, criterion = _load(user_module)
    model = model.double()
    data = [(x.double(), y) for x, y in data]
    op = he.KFACOperator(
        model, data, he.supervised_forward, he.supervised_loss_of_output(criterion)
    )
    dense = op.to_dense()
    values = torch.linalg.eigvalsh(dense)
    wanted = values.flip(0)[:2] if which == "LA" else values[:2]
    from hessian_eigenthings.cli.run import _exact_eigenpairs

    eig = _exact_eigenpairs(op, 2, which)
    torch.testing.assert_close(eig.eigenvalues, wanted, rtol=1e-10, atol=1e-13)
    for lam, u in zip(eig.eigenvalues, eig.eigenvectors, strict=True):
        assert float(u.norm()) == pytest.approx(1.0, rel=1e-12)
        torch.testing.assert_close(
            dense @ u, lam * u, rtol=0, atol=1e-10 * float(values.abs().max())
        )
    ref = he.loss_landscape(
        model, data, he.supervised_loss(criterion), directions=eig, dims=2, span=1.0, steps=3
    )
    np.testing.assert_allclose(np.array(res["landscape"]["losses"]), ref.losses.numpy(), rtol=1e-10)


DROPOUT_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make():
        gen = torch.Generator().manual_seed(123)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Tanh(), nn.Linear(8, 3))
        x = torch.randn(40, 6, generator=gen)
        y = torch.randint(0, 3, (40,), generator=gen)
        return model, [(x, y)], nn.CrossEntropyLoss()
    """
)
QUICK = ["-k", "2", "--trace-matvecs", "0", "--slq-runs", "0", "--no-plot", "--no-progress"]


def test_warnings_are_one_line_without_the_source_line(tmp_path: Path) -> None:
    """A warning during the run (dropout in training mode) is printed as ``warning: <message>``,
    without Python's second line (the command's own ``sys.exit(main())``)."""
    (tmp_path / "drop_model.py").write_text(DROPOUT_MODULE)
    proc = _run_cli(["--model", "drop_model.py:make", *QUICK, "-o", "out"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "dropout" in line]
    assert lines and all(line.startswith("warning: HessianOperator: dropout") for line in lines)
    assert "sys.exit(main())" not in proc.stderr and "Warning:" not in proc.stderr


@pytest.mark.filterwarnings("default::UserWarning")
def test_main_gives_warnings_display_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process too the run's warnings are one line each, and afterwards the caller's
    showwarning and filters are as they were."""
    import warnings

    (tmp_path / "drop_model.py").write_text(DROPOUT_MODULE)
    show, filters = warnings.showwarning, list(warnings.filters)
    assert (
        cli.main(
            ["--model", f"{tmp_path / 'drop_model.py'}:make", *QUICK, "-q", "-o", str(tmp_path)]
        )
        == 0
    )
    assert warnings.showwarning is show and warnings.filters == filters
    assert "warning: HessianOperator: dropout in training mode" in capsys.readouterr().err


def test_cpu_runs_say_how_many_threads_and_how_to_change_them(
    tmp_path: Path, user_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Torch's default of one thread per core made the main job 4x slower on a busy CPU; the
    run's output says the count and names --threads."""
    args = ["--model", f"{user_module}:make", "--device", "cpu", *QUICK, "-o", str(tmp_path)]
    assert cli.main(args) == 0
    n = torch.get_num_threads()
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("cpu: "))
    assert line.startswith(f"cpu: {n} torch thread") and "--threads N to change" in line
    assert cli.main([*args, "--threads", "1"]) == 0
    assert "cpu: 1 torch thread (--threads 1)\n" in capsys.readouterr().out
    assert cli.main([*args, "-q"]) == 0
    assert "cpu:" not in capsys.readouterr().out


def test_kronecker_eigenvalue_table_has_a_header(
    tmp_path: Path, user_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", f"{user_module}:make", "--operator", "kfac", *QUICK, "-o", str(tmp_path)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if "exact eigendecomposition" in line)
    assert lines[at + 1] == "    i   eigenvalue"
    assert lines[at + 2].startswith("    0   ") and lines[at + 3].startswith("    1   ")


def test_figure_numbers_eigenvalues_from_zero_as_the_console() -> None:
    """spectrum.png's index axis and the printed table (EigenResult.summary) both start at 0."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    A = torch.diag(torch.linspace(-1.0, 2.0, 40, dtype=torch.float64))
    op = he.LambdaOperator(lambda v: A @ v, 40, dtype=torch.float64)
    eig = he.lanczos(op, k=4, which="LA", seed=0)
    assert eig.summary().splitlines()[2].startswith("    0   ")
    fig = cli.plots.spectrum_figure(eig, None, None, "LA", "Hessian of a diagonal", "data: none")
    try:
        (line,) = [ln for ln in fig.axes[-1].get_lines() if len(ln.get_xdata()) == 4]
        assert list(line.get_xdata()) == [0, 1, 2, 3]
        assert "0" in fig.axes[-1].get_xlabel()
    finally:
        plt.close(fig)


def test_spectral_density_plot_uses_the_package_style() -> None:
    """SpectralDensityResult.plot draws as the package's other figures do (_plot_style): its
    colour whatever came before on the axes, a light grid, a small legend when labelled."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hessian_eigenthings import _plot_style as style

    A = torch.diag(torch.linspace(0.1, 2.0, 30, dtype=torch.float64))
    op = he.LambdaOperator(lambda v: A @ v, 30, dtype=torch.float64)
    density = he.spectral_density(op, num_runs=2, lanczos_steps=10, num_grid_points=100, seed=0)
    fig, ax = plt.subplots()
    try:
        ax.plot(
            [0.0, 1.0], [1.0, 1.0]
        )  # a line before: matplotlib's cycle would colour the next C1
        density.plot(ax, label="SLQ")
        assert ax.get_lines()[-1].get_color() == style.MEASURED
        assert any(g.get_visible() for g in ax.get_xgridlines())
        legend = ax.get_legend()
        assert legend is not None and legend.get_texts()[0].get_text() == "SLQ"
        density.plot(ax, color="k")  # the caller's colour wins
        assert ax.get_lines()[-1].get_color() == "k"
    finally:
        plt.close(fig)
