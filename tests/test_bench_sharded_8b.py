"""The 8 B run's machinery in benchmarks/bench_sharded.py, on CPU gloo ranks with a tiny Llama:
the meta-device build materialized by seeded rows (NOTE [seeded materialization]), runs stopped
and resumed across commands (NOTE [runs across commands]), and the top_hessian and slq sections.
float64 (the script's tiny workloads)."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_sharded as bs  # noqa: E402
from hessian_eigenthings import _torch_compat  # noqa: E402
from tests.launch import launch  # noqa: E402

pytest.importorskip("transformers")
# each launch starts the script on gloo ranks (10-40 s on a busy 2-core machine): marked slow
# the launches shard with FSDP2, which runs on the CPU from torch 2.6
no_gloo = not (
    dist.is_available() and dist.is_gloo_available() and _torch_compat.fsdp2_runs_on_cpu()
)
SCRIPT = str(ROOT / "benchmarks" / "bench_sharded.py")
# 2 sequences of 8 tokens: one a rank
TINY = ["--workload", "tiny_llama", "--meta", "--batch", "2", "--seq", "8"]
SLQ = ["--probes", "2", "--slq-steps", "6", "--basis-device", "cpu", "--checkpoint-every", "4"]


def _cfg() -> dict[str, Any]:
    return {**bs.TINY["llama"], "batch": 2, "seq": 8}


def _run(world: int, out: Path, *args: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    launch(world, out, [SCRIPT, *TINY, "--out", str(out), *args])
    return json.loads((out / f"bench_sharded_tiny_llama_fsdp{world}.json").read_text())


@pytest.fixture
def float64() -> Any:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the script does for its tiny workloads
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run on 2 ranks, never stopped: weights, top_hessian and slq."""
    if no_gloo:
        pytest.skip("needs torch.distributed, gloo")
    out = tmp_path_factory.mktemp("unbroken")
    sections = ["--sections", "weights,top_hessian,slq"]
    return out, _run(2, out, *sections, *SLQ, "--checkpoint-dir", str(out / "ckpt"))


# ---------------------------------------------------------------------------------------------
# (a) the meta-device build
# ---------------------------------------------------------------------------------------------


def test_rows_drawn_piecewise_equal_the_whole_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any cut of the rows (blocks straddled, empty pieces) gives the rows of the whole draw."""
    monkeypatch.setattr(bs, "INIT_BLOCK_NUMBERS", 3 * 7)  # 3 rows a block of a (10, 7) tensor
    shape = torch.Size([10, 7])
    whole = torch.empty(shape, dtype=torch.float64)
    kw = {"seed": 3, "name": "w", "std": 0.5, "gen_device": torch.device("cpu")}
    bs.fill_rows(whole, shape, 0, **kw)
    for cuts in ([0, 5, 10], [0, 4, 8, 10], [0, 1, 2, 3, 9, 10], [0, 10, 10]):
        for a, b in itertools.pairwise(cuts):
            piece = torch.full((b - a, 7), float("nan"), dtype=torch.float64)
            bs.fill_rows(piece, shape, a, **kw)
            assert torch.equal(piece, whole[a:b]), (cuts, a, b)
    other = torch.empty(shape, dtype=torch.float64)
    bs.fill_rows(other, shape, 0, **{**kw, "seed": 4})
    assert not torch.equal(other, whole)
    # what the draw is: N(0, std²) (70 numbers: the mean within 4 standard errors)
    assert abs(float(whole.mean())) < 4 * 0.5 / 70**0.5


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo, FSDP2 on the CPU")
def test_meta_build_equals_the_eager_build_on_one_and_two_ranks(
    unbroken: tuple[Path, dict[str, Any]], tmp_path: Path, float64: None
) -> None:
    out2, report = unbroken
    _run(1, tmp_path, "--sections", "weights")
    on = {
        w: torch.load(d / f"weights_w{w}.pt", weights_only=True)
        for w, d in ((1, tmp_path), (2, out2))
    }
    eager, _ = bs.build_eager_seeded(_cfg(), 0, torch.device("cpu"))
    expected = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    for w, got in on.items():
        assert set(got) == set(expected), w
        for name, t in expected.items():
            assert torch.equal(got[name], t.detach()), (w, name)
    # buffers: HF's own (computed when the module is built), not a copy of garbage
    hf, _ = bs.build(_cfg())
    for name, b in hf.named_buffers():
        assert torch.equal(on[2][name], b), name
    # an initialization, not leftover memory: N(0, 0.02²) matrices, norm scales 1
    emb = on[2]["model.embed_tokens.weight"]  # 101 x 32, tied to the head
    assert abs(float(emb.std()) - 0.02) < 0.002 and abs(float(emb.mean())) < 0.002
    assert torch.equal(on[2]["model.norm.weight"], torch.ones(32))
    assert report["parameters"] == sum(p.numel() for p in eager.parameters())


# ---------------------------------------------------------------------------------------------
# (b) stopped and resumed
# ---------------------------------------------------------------------------------------------


def test_gate_stops_only_after_a_save_and_lanczos_resumes_bit_for_bit(tmp_path: Path) -> None:
    """In one process: a lanczos stopped by the gate after 5 products resumes from its file to
    the bits of an unbroken call."""
    import hessian_eigenthings as he

    gen = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen, dtype=torch.float64))
    A = Q @ torch.diag(torch.linspace(-3.0, 10.0, 60, dtype=torch.float64)) @ Q.T

    def op() -> Any:
        return he.LambdaOperator(lambda v: A @ v, 60, dtype=torch.float64)

    kw = {"k": 2, "ncv": 8, "tol": 1e-10, "seed": 0, "which": "LA", "progress": False}
    whole = he.lanczos(op(), **kw)
    ckpt = tmp_path / "l.pt"
    first = op()
    gate = bs.ProductGate(bs.Ranks(torch.device("cpu")), None, 5, ckpt)
    with pytest.raises(bs.Stopped), gate.around(first):
        he.lanczos(first, checkpoint=ckpt, checkpoint_every=3, **kw)
    assert gate.products == 6  # due after 5, the save after the 6th: no product lost
    assert ckpt.exists() and "matvec" not in vars(first)  # the operator given back unwrapped
    again = op()
    resumed = he.lanczos(again, checkpoint=ckpt, checkpoint_every=3, **kw)
    assert torch.equal(resumed.eigenvalues, whole.eigenvalues)
    assert torch.equal(resumed.eigenvectors, whole.eigenvectors)
    assert resumed.iterations == whole.iterations and again.num_matvecs == whole.iterations - 6
    np.testing.assert_allclose(
        resumed.eigenvalues.numpy(), np.linalg.eigvalsh(A.numpy())[::-1][:2], rtol=1e-9
    )


def test_finished_rows_of_other_arguments_are_refused(tmp_path: Path) -> None:
    ranks = bs.Ranks(torch.device("cpu"))
    bs.Progress(tmp_path, {"k": 5, "tol": 1e-4}, ranks).record("x", {"eigenvalues": [1.0]})
    assert bs.Progress(tmp_path, {"k": 5, "tol": 1e-4}, ranks).done("x") == {"eigenvalues": [1.0]}
    with pytest.raises(SystemExit, match=r"other arguments \(k\)"):
        bs.Progress(tmp_path, {"k": 6, "tol": 1e-4}, ranks).done("x")


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo, FSDP2 on the CPU")
def test_stopped_and_resumed_run_equals_the_unbroken_one(
    unbroken: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """SLQ stopped by the deadline after its first probe, top_hessian after 12 products (saves
    every 4), then the same command again: the unbroken run's numbers, bit for bit."""
    ref_dir, ref = unbroken
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    one = _run(2, tmp_path / "one", "--sections", "slq", "--deadline-s", "0", *SLQ, *ckpt)
    assert not one["complete"] and one["stopped"]["section"] == "slq"
    assert one["stopped"]["products_this_command"] == 6  # the first probe, saved
    both = ["--sections", "top_hessian,slq", *SLQ, *ckpt]
    two = _run(2, tmp_path / "two", *both, "--max-products", "10")
    assert not two["complete"] and two["stopped"]["section"] == "top_hessian"
    assert two["stopped"]["products_this_command"] == 12
    for r in range(2):
        assert (tmp_path / "ckpt" / f"top_hessian.rank{r}of2.pt").exists()
    three = _run(2, tmp_path / "three", *both)
    assert three["complete"]
    top, ref_top = three["top_hessian"], ref["top_hessian"]
    assert top["eigenvalues"] == ref_top["eigenvalues"] and top["residuals"] == ref_top["residuals"]
    assert top["products"] == ref_top["products"]
    assert top["products_this_command"] == ref_top["products"] - 12
    assert three["slq"]["products_this_command"] == 6  # the second probe only
    assert three["slq"]["nodes"] == ref["slq"]["nodes"]
    assert three["slq"]["weights"] == ref["slq"]["weights"]
    got = torch.load(tmp_path / "three" / "bench_sharded_tiny_llama_slq.pt", weights_only=True)
    want = torch.load(ref_dir / "bench_sharded_tiny_llama_slq.pt", weights_only=True)
    assert torch.equal(got["density"], want["density"]) and torch.equal(got["grid"], want["grid"])


# ---------------------------------------------------------------------------------------------
# (c) the sections' output
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo, FSDP2 on the CPU")
def test_top_hessian_and_slq_write_their_rows_and_figure(
    unbroken: tuple[Path, dict[str, Any]], float64: None
) -> None:
    from scipy.sparse.linalg import eigsh

    import hessian_eigenthings as he

    out, report = unbroken
    assert report["complete"]
    top = report["top_hessian"]
    assert top["converged"] == 1 and top["which"] == "LA" and len(top["eigenvalues"]) == 1
    # the reference: scipy's ARPACK on the unsharded twin's whole-graph Hessian, whole batch
    model, _ = bs.build_eager_seeded(_cfg(), 0, torch.device("cpu"))
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    op = he.HessianOperator(model, [{"input_ids": ids}], bs.lm_loss, engine="autograd")
    (lam,) = eigsh(op.to_scipy(), k=1, which="LA", tol=1e-10, return_eigenvectors=False)
    assert top["eigenvalues"][0] == pytest.approx(float(lam), rel=1e-4)  # tol 1e-4 of lanczos

    slq = report["slq"]
    nodes, weights = np.array(slq["nodes"]), np.array(slq["weights"])
    assert nodes.shape == weights.shape == (2, 6) and slq["reorthogonalize"]
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-12)  # a quadrature a probe
    assert nodes.max() <= lam * (1 + 1e-8)  # Ritz values lie inside the spectrum
    assert slq["mass"] == pytest.approx(1.0, abs=1e-6)
    assert (out / slq["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert slq["peak_gib"] is None and len(slq["host_peak_gib_ranks"]) == 2  # CPU: host peaks


# ---------------------------------------------------------------------------------------------
# the recipe of docs/distributed.md ("An 8 B model on one node"), as written
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(no_gloo, reason="needs torch.distributed, gloo, FSDP2 on the CPU")
def test_docs_8b_recipe_runs_on_two_cpu_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/test_docs.py only compiles it (a torchrun script after the page's first one)."""
    fence = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
    (code,) = [b for b in fence.findall((ROOT / "docs" / "distributed.md").read_text())
               if "llama8b_spectrum.py" in b]  # fmt: skip
    script = tmp_path / "llama8b_spectrum.py"
    script.write_text(code)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the recipe's CPU branch
    # the launcher starts ranks in the repository: run the script from tmp_path, where its
    # checkpoint files go
    run = f"import os, runpy; os.chdir({str(tmp_path)!r}); runpy.run_path({str(script)!r}, run_name='__main__')"
    launch(2, tmp_path, ["-c", run])
    log = (tmp_path / "log0.txt").read_text()
    top = json.loads(re.search(r"top Hessian eigenvalue (\[.*\])", log).group(1))  # type: ignore[union-attr]
    node = float(re.search(r"largest quadrature node (\S+)", log).group(1))  # type: ignore[union-attr]
    assert len(top) == 1 and np.isfinite(top[0]) and top[0] > 0
    assert node <= top[0] * (1 + 1e-3)  # a Ritz value of the density's run: inside the spectrum
    # lanczos deleted its files when it finished; SLQ keeps its own (a later call returns them)
    assert not list(tmp_path.glob("top_hessian.rank*.pt"))
    assert sorted(p.name for p in tmp_path.glob("slq.rank*.pt")) == [
        "slq.rank0of2.pt",
        "slq.rank1of2.pt",
    ]
