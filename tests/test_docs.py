"""The documentation: `mkdocs build --strict` passes, every public name is in the API
reference, and every ```python block in docs/ runs.

Rules for code blocks (docs/**/*.md, in page order, one namespace per page):

- every ```python block is executed, top to bottom, in a fresh namespace per page;
- a block whose first line is ``# requires: pkg[, pkg]`` is skipped (with the rest of
  its page) when a package is missing;
- a block that is a launch script for several processes (it mentions ``torchrun``) is
  only compiled, and so is every later block of its page (they may use its names).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if _FENCE.search(p.read_text()))


# DESIGN.md section 2 (the 1.0 surface) and section 3 (the 0.x surface).
PUBLIC_1_0 = [
    "CurvatureOperator",
    "KroneckerOperator",
    "LambdaOperator",
    "HessianOperator",
    "GGNOperator",
    "EmpiricalFisherOperator",
    "DDPHessianOperator",
    "lanczos",
    "lanczos_tridiagonal",
    "LanczosTridiag",
    "deflated_power_iteration",
    "power_iteration_one",
    "trace",
    "hutchinson",
    "hutch_plus_plus",
    "TraceResult",
    "spectral_density",
    "SpectralDensityResult",
    "EigenResult",
    "supervised_loss",
    "supervised_forward",
    "supervised_loss_of_output",
    "supervised_per_sample_loss",
    "cross_entropy_loss_of_output",
    "mse_loss_of_output",
    "hf_lm_loss",
    "hf_seq2seq_loss",
    "hf_lm_forward",
    "hf_lm_loss_of_output",
    "tlens_loss",
    "tlens_forward",
    "tlens_loss_of_output",
    "ParamFilter",
    "match_names",
    "match_regex",
    "select_parameters",
    "params_to_vector",
    "vector_to_params",
    "LinAlgBackend",
    "SingleDeviceBackend",
    "JacobianOperator",
    "TransposedJacobianOperator",
    "OutputHessianSqrtLoss",
]
PUBLIC_0_X = [
    "compute_hessian_eigenthings",
    "HVPOperator",
    "power_iteration",
    "deflated_power_iteration",
    "lanczos",
    "Operator",
    "LambdaOperator",
    "log",
    "maybe_fp16",
    "progress_bar",
    "format_time",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if not _has(module):
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_mkdocs_build_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "operators" / "index.html").is_file()
    # the root migration guide is included verbatim
    assert (
        "Migrating from hessian-eigenthings 0.x" in (site / "migration" / "index.html").read_text()
    )


@pytest.mark.parametrize("name", sorted(set(PUBLIC_1_0)))
def test_public_1_0_name_in_reference(site: Path, name: str) -> None:
    html = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    # mkdocstrings gives every documented object an anchor named by its path
    assert re.search(rf'id="hessian_eigenthings\.[\w.]*\b{re.escape(name)}"', html), name


@pytest.mark.parametrize("name", sorted(set(PUBLIC_0_X)))
def test_public_0_x_name_in_reference(site: Path, name: str) -> None:
    html = (site / "reference" / "compat" / "index.html").read_text()
    assert re.search(rf'id="hessian_eigenthings\.compat\.[\w.]*\b{re.escape(name)}"', html), name


def test_version_documented(site: Path) -> None:
    assert "__version__" in (site / "reference" / "index.html").read_text()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    compile_only = False
    for i, match in enumerate(_FENCE.finditer(page.read_text())):
        code = match.group(1)
        where = f"{page.relative_to(REPO)} block {i + 1}"
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        if first.startswith("# requires:"):
            missing = [m.strip() for m in first.split(":", 1)[1].split(",") if not _has(m.strip())]
            if missing:
                pytest.skip(f"{where} needs {', '.join(missing)}")
        compile_only = compile_only or "torchrun" in code
        compiled = compile(code, where, "exec")
        if compile_only:
            continue
        with warnings.catch_warnings():
            # curvlinops imports linear_operator, whose import-time torch.jit.script warns on
            # torch >= 2.10: third-party noise, not something the docs could fix
            warnings.filterwarnings(
                "ignore", message=".*torch.jit.script.*", category=DeprecationWarning
            )
            exec(compiled, namespace)


README = REPO / "README.md"


def test_readme_python_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.chdir(tmp_path)
    blocks = _FENCE.findall(README.read_text())
    assert blocks, "README has no ```python block"
    namespace: dict[str, object] = {"__name__": "docs_readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i + 1}", "exec"), namespace)
    # "top" in the README is the largest algebraic eigenvalues: check against the dense matrix
    op, top = namespace["op"], namespace["top"]
    dense = (op @ torch.eye(op.size)).double()  # type: ignore[operator, attr-defined]
    expected = torch.linalg.eigvalsh(0.5 * (dense + dense.T)).flip(0)[:5]
    torch.testing.assert_close(top.eigenvalues, expected, rtol=1e-3, atol=1e-4)  # type: ignore[attr-defined]


def test_readme_install_links_version_and_commands() -> None:
    import hessian_eigenthings
    from hessian_eigenthings import cli

    text = README.read_text()
    version = hessian_eigenthings.__version__
    assert f"documents version {version}" in text
    assert f'pip install "hessian-eigenthings[plotting]=={version}"' in text
    for target in re.findall(r"\]\(((?:docs/)[^)]+)\)", text):
        assert (REPO / target).is_file(), target
    assert "(docs/quickstart.md)" in text and "(docs/howto/" in text
    # the two commands that do all the set-up, and one meaning of "top" shared with the CLI
    assert "bash scripts/run.sh" in text and "bash scripts/test.sh" in text
    assert 'which="LA"' in text and "largest algebraic" in text
    assert cli.build_parser().parse_args([]).which == "LA"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as_rank(rank: int, world: int, port: int, code: str, name: str) -> dict[str, object]:
    """Run a launch script of docs/distributed.md as one rank, with the variables torchrun would
    set; its namespace after."""
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(code, name, "exec"), namespace)
    return namespace


def _ddp_doc_worker(rank: int, world: int, port: int, code: str, out: str) -> None:
    import torch

    namespace = _run_as_rank(rank, world, port, code, "docs/distributed.md block 1")
    torch.save(namespace["result"].eigenvalues, f"{out}/rank{rank}.pt")  # type: ignore[attr-defined]


def test_distributed_launch_block_runs_under_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn

    import hessian_eigenthings as he

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    code = _FENCE.findall((DOCS / "distributed.md").read_text())[0]
    assert "torchrun" in code
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two CPU processes: the block picks gloo
    mp.spawn(_ddp_doc_worker, args=(2, _free_port(), code, str(tmp_path)), nprocs=2, join=True)
    values = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.testing.assert_close(
        values[0], values[1], rtol=0, atol=0
    )  # every rank gets the same result

    # the reference: the block's model and data in one process, dense Hessian of all 512 samples
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5)).double()
    x, y = torch.randn(512, 20).double(), torch.randint(0, 5, (512,))
    op = he.HessianOperator(model, [(x, y)], he.supervised_loss(nn.CrossEntropyLoss()))
    dense = op @ torch.eye(op.size, dtype=torch.float64)
    expected = torch.linalg.eigvalsh(0.5 * (dense + dense.T)).flip(0)[:5]
    torch.testing.assert_close(values[0], expected, rtol=1e-3, atol=1e-5)


def _fsdp_doc_worker(rank: int, world: int, port: int, code: str, out: str) -> None:
    import torch

    namespace = _run_as_rank(rank, world, port, code, "docs/distributed.md block 2")
    found = {k: namespace[k].eigenvalues for k in ("result", "ggn_result")}  # type: ignore[attr-defined]
    torch.save(found, f"{out}/rank{rank}.pt")


def test_distributed_fsdp_recipe_runs_under_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FSDP recipe, as written, on two CPU processes: every rank gets the same eigenvalues,
    and they are the single-process ones (the sharded walk is exact)."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    from torch import nn

    import hessian_eigenthings as he

    transformers = pytest.importorskip("transformers")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"):
        pytest.skip("the recipe imports FSDP2's public fully_shard (torch 2.6 and later)")
    code = _FENCE.findall((DOCS / "distributed.md").read_text())[1]
    assert "torchrun" in code and "fully_shard" in code
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two CPU processes: the recipe picks gloo
    mp.spawn(_fsdp_doc_worker, args=(2, _free_port(), code, str(tmp_path)), nprocs=2, join=True)
    found = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for key in ("result", "ggn_result"):
        torch.testing.assert_close(found[0][key], found[1][key], rtol=0, atol=0)

    # the reference: the recipe's CPU model and data in one process
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    model = model.eval().double()
    ids = torch.randint(0, 101, (8, 16))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    def logits_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return m(input_ids=batch[0], use_cache=False).logits[:, :-1].flatten(0, 1)

    ce = he.supervised_loss_of_output(nn.CrossEntropyLoss())
    ops = {
        "result": he.HessianOperator(model, [ids], loss_fn),
        "ggn_result": he.GGNOperator(model, [(ids, ids[:, 1:].flatten())], logits_fn, ce),
    }
    for key, op in ops.items():
        ref = he.lanczos(op, k=5, seed=0, tol=1e-10).eigenvalues
        torch.testing.assert_close(found[0][key], ref, rtol=1e-6, atol=0)


def test_readme_points_only_inside_the_repository() -> None:
    text = README.read_text()
    assert "../" not in text  # e.g. a design note of the workspace, not of the repository
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (REPO / target).resolve()
        assert path.is_relative_to(REPO) and path.exists(), target


def test_laplace_posterior_samples_have_the_posterior_covariance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/howto/laplace.md draws samples θ* + P^{-1/2} z block by block: their covariance is P⁻¹."""
    import torch

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_laplace"}
    for i, code in enumerate(_FENCE.findall((DOCS / "howto" / "laplace.md").read_text())):
        exec(compile(code, f"laplace.md block {i + 1}", "exec"), namespace)
    sample = namespace["posterior_sample"]
    theta, P = namespace["theta"], namespace["P"]
    torch.manual_seed(1)
    draws = torch.stack([sample() for _ in range(4000)])  # type: ignore[operator]
    assert draws.shape == (4000, theta.numel())  # type: ignore[attr-defined]
    cov = torch.cov((draws - theta).T)  # type: ignore[operator]
    expected = torch.linalg.inv(P)  # type: ignore[arg-type]
    assert float(cov.trace()) == pytest.approx(float(expected.trace()), rel=0.05)
    # whitened by the dense precision, a sample's squared norm is chi-squared with n degrees of
    # freedom: mean n, here to about 0.2 % (a wrong scale or a wrong block would be far off)
    centred = draws - theta  # type: ignore[operator]
    quad = ((centred @ P) * centred).sum(1)  # type: ignore[operator]
    assert float(quad.mean()) == pytest.approx(theta.numel(), rel=0.02)  # type: ignore[attr-defined]
