"""``hessian-eigenthings influence``: its printed top-k and its JSON against scores computed
independently through the public influence API, a fresh process giving the same numbers, the
figure, one-line refusals, and the flag-only command beside it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hessian_eigenthings import cli, influence
from hessian_eigenthings.cli.influence_problem import (
    ANIMALS,
    CharTokenizer,
    builtin_influence_problem,
)

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
N_TRAIN, STEPS, QUERIES, K = 16, 30, 2, 3
SMALL = [
    "--n-train",
    str(N_TRAIN),
    "--train-steps",
    str(STEPS),
    "--queries",
    str(QUERIES),
    "--top-k",
    str(K),
    "--no-progress",
]
_ROW = re.compile(r'^  (helpful|harmful|       )  ([+-]\d\.\d{4}e[+-]\d+)\s+(\d+)  "(.*)"$')


@dataclass
class Printed:
    queries: list[str]
    helpful: list[list[tuple[int, float, str]]]  # per query: (index, printed score, text)
    harmful: list[list[tuple[int, float, str]]]


def _parse(out: str) -> Printed:
    printed = Printed([], [], [])
    label = ""
    for line in out.splitlines():
        if m := re.match(r'^query (\d+): "(.*)"$', line):
            assert int(m.group(1)) == len(printed.queries)
            printed.queries.append(m.group(2))
            printed.helpful.append([])
            printed.harmful.append([])
        elif m := _ROW.match(line):
            label = m.group(1).strip() or label
            rows = printed.helpful if label == "helpful" else printed.harmful
            rows[-1].append((int(m.group(3)), float(m.group(2)), m.group(4)))
    return printed


@pytest.fixture
def one_thread() -> Iterator[None]:
    # the command scores with one torch thread; so does the reference, so that both take the
    # same eigenvectors of degenerate factor eigenvalues (EK-FAC's corrections depend on them)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, bool]:
    """One in-process run: its stdout, its folder, and whether it left the caller's RNG and
    thread count as they were."""
    out = tmp_path_factory.mktemp("influence")
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    capture = _Capture()
    with capture:
        code = cli.main(["influence", *SMALL, "-o", str(out)])
    assert code == 0, capture.err
    untouched = torch.get_num_threads() == threads and torch.equal(
        torch.random.get_rng_state(), rng
    )
    return capture.out, out, untouched


class _Capture:
    """stdout and stderr of an in-process run (capsys is function-scoped)."""

    def __enter__(self) -> None:
        import contextlib
        import io

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self.out, self.err = self._out.getvalue(), self._err.getvalue()


def _reference() -> tuple[torch.Tensor, list[str], list[str]]:
    """The scores of the same model and data, through ``influence.fit(...).pairwise_scores``."""
    problem = builtin_influence_problem(
        n_train=N_TRAIN, n_queries=QUERIES, seed=0, train_steps=STEPS
    )
    fitted = influence.fit(problem.model, problem.train_data, influence.causal_lm_task())
    scores = fitted.pairwise_scores(problem.query_data, problem.train_data, progress=False)
    return scores, problem.train_texts, problem.query_texts


def test_printed_top_k_and_json_equal_the_public_api(
    in_process: tuple[str, Path, bool], one_thread: None
) -> None:
    out, folder, untouched = in_process
    assert untouched, "the in-process run changed the caller's RNG state or thread count"
    S, train_texts, query_texts = _reference()
    assert S.shape == (QUERIES, N_TRAIN) and S.dtype == torch.float64
    printed = _parse(out)
    assert printed.queries == query_texts
    for q in range(QUERIES):
        for rows, sign in ((printed.helpful[q], -1.0), (printed.harmful[q], 1.0)):
            # the k largest of sign * score, best first; ties (duplicate sentences) may come in
            # either order, so each printed index must carry the value of its rank
            ref = torch.topk(sign * S[q], K)
            assert len(rows) == K and len({i for i, _, _ in rows}) == K
            for r, (i, value, text) in enumerate(rows):
                assert sign * float(S[q, i]) == pytest.approx(float(ref.values[r]), rel=1e-9)
                assert value == pytest.approx(float(S[q, i]), rel=1e-4)  # printed with 5 digits
                assert text == train_texts[i]
            if len(set(ref.values.tolist())) == K:
                assert [i for i, _, _ in rows] == ref.indices.tolist()

    doc = json.loads((folder / "influence.json").read_text())
    torch.testing.assert_close(
        torch.tensor(doc["scores"], dtype=torch.float64), S, rtol=1e-9, atol=0.0
    )
    assert doc["train"]["texts"] == train_texts and doc["queries"] == query_texts
    top = doc["top_k"]
    assert [[i for i, _, _ in rows] for rows in printed.helpful] == top["negative_indices"]
    assert [[i for i, _, _ in rows] for rows in printed.harmful] == top["positive_indices"]
    assert doc["settings"]["strategy"] == "ekfac" and doc["settings"]["top_k"] == K
    assert doc["versions"]["torch"] == torch.__version__
    assert set(doc["seconds"]) == {"model", "fit", "scores", "total"}
    png = (folder / "influence.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_fresh_process_gives_the_same_numbers(
    in_process: tuple[str, Path, bool], tmp_path: Path
) -> None:
    out, folder, _ = in_process
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "hessian_eigenthings", "influence", *SMALL, "-o", "sub"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    first = json.loads((folder / "influence.json").read_text())
    second = json.loads((tmp_path / "sub" / "influence.json").read_text())
    assert second["scores"] == first["scores"]  # seeded: bit for bit
    assert second["top_k"] == first["top_k"]
    assert _parse(proc.stdout) == _parse(out)
    assert (tmp_path / "sub" / "influence.png").read_bytes()[:4] == b"\x89PNG"
    assert proc.stdout.rstrip().splitlines()[-1].startswith("wrote sub/influence.json")


def test_own_queries_and_kfac(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "the cat eats fish."
    args = [*SMALL[:4], "--top-k", "2", "--query", text, "--strategy", "kfac", "--no-plot"]
    assert cli.main(["influence", *args, "-o", str(tmp_path)]) == 0
    printed = _parse(capsys.readouterr().out)
    assert printed.queries == [text] and len(printed.helpful[0]) == 2
    doc = json.loads((tmp_path / "influence.json").read_text())
    assert doc["queries"] == [text] and doc["settings"]["strategy"] == "kfac"
    assert not (tmp_path / "influence.png").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--strategy", "hessian"], "--strategy: invalid choice"),
        (["--top-k", "0"], "--top-k: expected an integer from 1"),
        (["--top-k", "9", "--n-train", "8"], "--top-k 9 is more than the 8 training"),
        (["--damping", "-1"], "--damping: expected a finite number >= 0"),
        (["--damping", "nan"], "--damping: expected a finite number >= 0"),
        (["--strategy", "ggn", "--damping", "0"], "--strategy ggn needs --damping > 0"),
        (["--n-train", "many"], "--n-train: expected an integer"),
        (["--queries", "0"], "--queries: expected an integer from 1"),
        (["--query", "The cat!"], "characters '!T' are not in the vocabulary"),
        (["--query", "a"], "a query has 2 to"),
        (["--query", "the cat", "--queries", "2"], "cannot go with --query"),
        (["--out"], "--out: expected one argument"),
    ],
)
def test_bad_arguments_one_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["influence", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert errors == [err[-1]], err  # one line says what is wrong, after argparse's usage
    assert errors[0].startswith("hessian-eigenthings influence: error: ") and says in errors[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["influence", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]


def test_builtin_problem_is_seeded_and_tokenizes_by_character() -> None:
    a = builtin_influence_problem(n_train=8, n_queries=5, seed=4, train_steps=2)
    b = builtin_influence_problem(n_train=8, n_queries=5, seed=4, train_steps=2)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert a.train_texts == b.train_texts and a.query_texts == b.query_texts
    # one generated query per animal in turn, held out from the training sentences
    assert [t.split()[1 if t.split()[1] in ANIMALS else 2] for t in a.query_texts[:4]] == list(
        ANIMALS
    )
    assert not set(a.query_texts) & set(a.train_texts)
    tok = CharTokenizer()
    batch = a.train_data[0]
    for row, mask, text in zip(
        batch["input_ids"], batch["attention_mask"], a.train_texts, strict=True
    ):
        assert tok.decode(row.tolist()) == text and int(mask.sum()) == len(text)
    assert not a.model.training


def test_flag_only_invocation_still_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--synthetic", "--train-steps", "0", "-k", "2", "--trace-matvecs", "0"]
    args += ["--slq-runs", "0", "--no-plot", "-o", str(tmp_path)]
    assert cli.main(args) == 0
    assert "top 2 eigenvalues" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["eigenvalues"]["method"] == (
        "lanczos"
    )


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """``hessian-eigenthings influence | head -1``: no BrokenPipeError traceback, status 1."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hessian_eigenthings", "influence", *SMALL, "--no-plot"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as head does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 1, err
    assert first and "Traceback" not in err and "BrokenPipeError" not in err, err
