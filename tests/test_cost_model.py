"""benchmarks/cost_model.py: its formulas on hand-countable shapes, its calibration, and the
table in docs/distributed.md ("Cost model") equal to what the script prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is a folder of the repository, not of the package

from benchmarks import cost_model as cm  # noqa: E402

# d 4, 2 blocks, 2 heads of 2 (1 key-value head: kv 2), MLP 8, vocabulary 10, 3 tokens a sequence
TOY = cm.Shape("toy", d=4, layers=2, heads=2, kv_heads=1, mlp=8, vocab=10, tied=False, seq=3)


def test_parameters_by_hand() -> None:
    # q, o: 4x4 each; k, v: 4x2 each; gate, up, down: 4x8 each; two norms of 4
    assert TOY.kv == 2
    assert TOY.block_params == 16 + 16 + 8 + 8 + 3 * 32 + 8 == 152
    assert TOY.outside_params == 40 + 40 + 4  # embedding, head, final norm
    assert TOY.params == 2 * 152 + 84 == 388
    tied = cm.Shape("tied", d=4, layers=2, heads=2, kv_heads=1, mlp=8, vocab=10, tied=True)
    assert tied.params == 388 - 40


def test_flops_by_hand() -> None:
    # matmuls: 2 blocks of 152 - 8 (norms) + the head's 40 = 328 parameters, 2 FLOPs each a token;
    # attention: 2 products of s x s x d a sequence = 4·T·s·d a layer
    assert TOY.forward_flops(6) == 2 * 328 * 6 + 4 * 2 * 6 * 3 * 4 == 4512


def test_llama_parameter_counts() -> None:
    """The published sizes."""
    assert cm.LLAMA_1B.params == 1_235_814_400
    assert cm.LLAMA_8B.params == 8_030_261_248
    assert cm.LLAMA_70B.params == 70_553_706_496
    assert cm.LLAMA_405B.params == 405_853_388_800


def test_communication_by_hand() -> None:
    # volumes: Hessian = record 1 + forward walk 2 (parameters and direction) + reduce-scatter 1;
    # GGN adds the backward walk's gather of the parameters; a training step 2 gathers + 1
    assert (cm.HESSIAN_VOLUMES, cm.GGN_VOLUMES, cm.STEP_VOLUMES) == (4, 5, 3)
    assert cm.communication_bytes(TOY, 4) == 4 * 388 * 4
    # a ring moves (W-1)/W of the volume through each GPU at the slowest link
    assert cm.Cluster(2).collective_seconds(900e9) == pytest.approx(450e9 / 450e9)
    assert cm.Cluster(8).link == 450e9 and cm.Cluster(16).link == 50e9
    assert cm.Cluster(64).collective_seconds(64e9) == pytest.approx(63e9 / 50e9)


def test_memory_by_hand() -> None:
    mem = cm.memory_bytes(TOY, cm.Cluster(4), tokens=6)
    assert mem["shards"] == 388 / 4 * 4
    assert mem["basis"] == 21 * mem["shards"]
    assert mem["whole"] == 3 * (152 + 84) * 4
    assert mem["boundaries"] == 2 * 3 * 6 * 4 * 4  # values and tangents at 3 boundaries
    # 6d + 2kv + 4m + heads·s = 24 + 4 + 32 + 6 numbers a token, twice (tangents)
    assert mem["block"] == 2 * 66 * 6 * 4


def test_calibration_reproduces_the_measured_point() -> None:
    shape, cluster, tokens = cm.LLAMA_1B, cm.Cluster(2), 4096
    cal = cm.calibrate(shape, cluster, tokens, cm.MEASURED_1B)
    assert cal == cm.CALIBRATION
    step = cm.step_seconds(shape, cluster, tokens, cal.flops_per_second)
    assert step == pytest.approx(cm.MEASURED_1B.step, rel=1e-12)
    for kind, seen in (("hessian", 3.32), ("ggn", 1.93)):
        assert cm.product_seconds(shape, cluster, tokens, kind, cal) == pytest.approx(seen)
    # uncalibrated, the walk is as fast per FLOP as a training step: 10/3 and 7/3 of its compute
    raw = cm.product_seconds(shape, cluster, tokens, "hessian", None)
    comm = cluster.collective_seconds(cm.communication_bytes(shape, cm.HESSIAN_VOLUMES))
    assert raw == pytest.approx(10 / 3 * step + comm)
    assert cal.hessian_slowdown > 1 and cal.ggn_slowdown > 1


def test_the_docs_table_is_the_scripts_output() -> None:
    page = (REPO / "docs" / "distributed.md").read_text()
    start = page.index(cm.TABLE_MARK) + len(cm.TABLE_MARK) + 1
    end = page.index("\n\n", start) + 1
    assert page[start:end] == cm.table(), "run python benchmarks/cost_model.py --write-docs"
