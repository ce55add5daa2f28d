"""What a sharded curvature product costs on Llama shapes: a model, calibrated on one measurement.

For a decoder shape, a number of GPUs and tokens per rank, it counts the parameters, the
communication of one Hessian or GGN product by the FSDP layer walk (NOTE [sharded layer walk]
in ``operators/sharded_walk.py``), the memory a rank holds, and the time of a product in
training steps. ``python benchmarks/cost_model.py`` prints the table of docs/distributed.md
("Cost model"); ``tests/test_cost_model.py`` checks that the page holds exactly this output and
the formulas on hand-countable shapes.

Assumptions (the table says the same):
- float32 everywhere (4 bytes a number), TF32 off, eager attention (the walk's kernel);
- compute: a forward of ``T`` tokens costs ``2 · (matmul parameters) · T`` plus ``4 · T · s · d``
  a layer for attention's two ``s x s`` products (eager attention computes the whole square);
  a training step is 3 forward-costs; the walk 9 a block for a Hessian product with every
  block's graph kept (NOTE [kept layer graphs]), 6 for a GGN product, each plus 1 for the
  ordinary FSDP forward that records the batch;
- communication per product, in parameter-sized volumes: the recording forward's all-gather
  (1), the forward walk's all-gather of parameters and direction (2), the GGN's backward walk's
  all-gather of the parameters (1; the Hessian's none with kept graphs, 2 without), the
  reduce-scatter of the product (1): Hessian 4, GGN 5, a training step 3 (two all-gathers, one
  reduce-scatter). A ring collective moves ``(W − 1) / W`` of the volume through each GPU at
  the slowest link of the ring: ~450 GB/s a GPU inside a node (NVLink), ~50 GB/s a GPU between
  nodes (one 400 Gb/s NIC a GPU). The walk waits for its gathers (no prefetch): a product's time
  is compute plus communication; a training step overlaps them (the larger of the two);
- compute efficiency is calibrated on the measured point (Llama-3.2-1B shape, 2 x H100): the
  training step fixes the FLOP rate, and each product kind's measured time fixes how much
  slower the walk's kernels run than a training step's (tangents, small batched jvps);
- memory a rank: its parameter shards, a Krylov basis of ``ncv + b = 21`` shard-sized vectors
  (lanczos' default; on the device or, with ``basis_device="cpu"``, in host memory), one block
  and the parameters outside the blocks whole with their direction and product blocks (3
  numbers a parameter), the blocks' boundary activations and their tangents, and one block's
  working set (values and tangents of its activations; an estimate: ``6d + 2·kv + 4m + heads·s``
  numbers a token for a training step's activations of a block, twice that with tangents).
  Kept graphs (about twice a block's training activations each) take what memory is left.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

BYTES = 4  # float32
GB = 1e9

#: forward-costs of one product per block, and of a training step (NOTE [kept layer graphs])
HESSIAN_FORWARDS = 9 + 1  # kept graphs: forward walk 3, backward walk 6; + the recording forward
GGN_FORWARDS = 6 + 1  # forward walk 3, backward walk 3; + the recording forward
STEP_FORWARDS = 3
#: parameter-sized volumes moved per product (all-gathers and the reduce-scatter)
HESSIAN_VOLUMES = 1 + 2 + 0 + 1
GGN_VOLUMES = 1 + 2 + 1 + 1
STEP_VOLUMES = 2 + 1
#: lanczos' default basis: ncv = 20 vectors and a block of 1
BASIS_VECTORS = 21


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder: ``layers`` blocks of grouped-query attention and a gated MLP."""

    name: str
    d: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool
    seq: int = 1024

    @property
    def kv(self) -> int:
        return self.kv_heads * (self.d // self.heads)

    @property
    def block_params(self) -> int:
        attention = 2 * self.d * self.d + 2 * self.d * self.kv
        return attention + 3 * self.d * self.mlp + 2 * self.d  # + two norms

    @property
    def outside_params(self) -> int:
        """Embedding, the LM head unless tied, the final norm."""
        return self.vocab * self.d * (1 if self.tied else 2) + self.d

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.outside_params

    def forward_flops(self, tokens: int) -> float:
        """One forward of ``tokens`` tokens (in sequences of ``seq``): the matmuls (the blocks'
        and the head's; the embedding is a lookup) and attention's two ``s x s`` products."""
        matmul = self.layers * (self.block_params - 2 * self.d) + self.vocab * self.d
        return 2.0 * matmul * tokens + 4.0 * self.layers * tokens * self.seq * self.d

    def block_activations(self) -> int:
        """Numbers a token of a training step's activations of one block (an estimate)."""
        return 6 * self.d + 2 * self.kv + 4 * self.mlp + self.heads * self.seq


LLAMA_1B = Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, tied=True)
LLAMA_8B = Shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, tied=False)
LLAMA_70B = Shape("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256, tied=False)
LLAMA_405B = Shape("Llama-3.1-405B", 16384, 126, 128, 8, 53248, 128256, tied=False)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    intra_node: float = 450e9  # bytes/s a GPU, NVLink
    inter_node: float = 50e9  # bytes/s a GPU, one 400 Gb/s NIC a GPU

    @property
    def link(self) -> float:
        """The slowest link of a ring over every GPU."""
        return self.intra_node if self.gpus <= self.gpus_per_node else self.inter_node

    def collective_seconds(self, volume_bytes: float) -> float:
        """Ring all-gathers / reduce-scatters of ``volume_bytes`` (the whole tensor) in all."""
        w = self.gpus
        return volume_bytes * (w - 1) / w / self.link


@dataclass(frozen=True)
class Measured:
    """A measured point: FSDP training step, Hessian and GGN walk products (seconds)."""

    step: float
    hessian: float
    ggn: float


#: 2 x H100, fp32, TF32 off, 8 x 1024 tokens (4096 a rank); benchmarks/RESULTS.md
MEASURED_1B = Measured(step=0.765, hessian=3.32, ggn=1.93)


@dataclass(frozen=True)
class Calibration:
    flops_per_second: float  # of a training step
    hessian_slowdown: float  # the walk's kernels against a training step's, per FLOP
    ggn_slowdown: float


def communication_bytes(shape: Shape, volumes: int) -> float:
    return float(volumes * shape.params * BYTES)


def _raw_seconds(
    shape: Shape, cluster: Cluster, tokens: int, forwards: int, volumes: int, rate: float
) -> tuple[float, float]:
    """(compute, communication) seconds of a product at the training step's FLOP rate."""
    compute = forwards * shape.forward_flops(tokens) / rate
    return compute, cluster.collective_seconds(communication_bytes(shape, volumes))


def step_seconds(shape: Shape, cluster: Cluster, tokens: int, rate: float) -> float:
    compute = STEP_FORWARDS * shape.forward_flops(tokens) / rate
    return max(compute, cluster.collective_seconds(communication_bytes(shape, STEP_VOLUMES)))


def calibrate(shape: Shape, cluster: Cluster, tokens: int, measured: Measured) -> Calibration:
    """The FLOP rate from the measured training step (its communication overlapped), then each
    product kind's slowdown from its measured time less its communication."""
    rate = STEP_FORWARDS * shape.forward_flops(tokens) / measured.step
    slow = []
    for forwards, volumes, seconds in (
        (HESSIAN_FORWARDS, HESSIAN_VOLUMES, measured.hessian),
        (GGN_FORWARDS, GGN_VOLUMES, measured.ggn),
    ):
        compute, comm = _raw_seconds(shape, cluster, tokens, forwards, volumes, rate)
        slow.append((seconds - comm) / compute)
    return Calibration(rate, slow[0], slow[1])


def product_seconds(
    shape: Shape, cluster: Cluster, tokens: int, kind: str, cal: Calibration | None
) -> float:
    """A product's time; ``cal`` None: the raw model (the walk as fast per FLOP as training)."""
    forwards, volumes = (
        (HESSIAN_FORWARDS, HESSIAN_VOLUMES) if kind == "hessian" else (GGN_FORWARDS, GGN_VOLUMES)
    )
    rate = (cal or CALIBRATION).flops_per_second
    compute, comm = _raw_seconds(shape, cluster, tokens, forwards, volumes, rate)
    slowdown = (
        1.0 if cal is None else (cal.hessian_slowdown if kind == "hessian" else cal.ggn_slowdown)
    )
    return slowdown * compute + comm


def memory_bytes(shape: Shape, cluster: Cluster, tokens: int) -> dict[str, float]:
    """What a rank holds during a product (the module docstring)."""
    shard = shape.params / cluster.gpus * BYTES
    return {
        "shards": shard,
        "basis": BASIS_VECTORS * shard,
        "whole": 3 * (shape.block_params + shape.outside_params) * BYTES,
        "boundaries": 2 * (shape.layers + 1) * tokens * shape.d * BYTES,
        "block": 2 * shape.block_activations() * tokens * BYTES,
    }


CALIBRATION = calibrate(LLAMA_1B, Cluster(2), 4096, MEASURED_1B)

#: (shape, GPUs, tokens a rank, what was measured there)
ROWS: list[tuple[Shape, int, int, Measured | None]] = [
    (LLAMA_1B, 2, 4096, MEASURED_1B),
    (LLAMA_8B, 4, 4096, None),  # planned on 4 GPUs, not measured (no 4-GPU machine was lent)
    (LLAMA_8B, 64, 4096, None),
    (LLAMA_70B, 64, 2048, None),
    (LLAMA_405B, 64, 1024, None),
]


def _gb(x: float) -> str:
    return f"{x / GB:,.0f}" if x >= 100 * GB else f"{x / GB:.3g}"


def table() -> str:
    """The cost model's table for docs/distributed.md (markdown)."""
    lines = [
        "| model | params | GPUs | tokens a rank | sent a GPU a product (Hessian / GGN) | "
        "training step | Hessian product | GGN product | memory a rank (GB): shards, basis of 21, "
        "block and outside whole, boundaries, block working set; on the device with the basis "
        "on the host | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, gpus, tokens, measured in ROWS:
        cluster = Cluster(gpus)
        rate = CALIBRATION.flops_per_second
        step = step_seconds(shape, cluster, tokens, rate)
        w = (gpus - 1) / gpus
        sent = [communication_bytes(shape, v) * w for v in (HESSIAN_VOLUMES, GGN_VOLUMES)]
        cells = []
        for kind in ("hessian", "ggn"):
            model = product_seconds(shape, cluster, tokens, kind, CALIBRATION)
            cell = f"{model:.3g} s ({model / step:.2f} steps)"
            if measured is not None:
                raw = product_seconds(shape, cluster, tokens, kind, None)
                seen = measured.hessian if kind == "hessian" else measured.ggn
                cell += (
                    f"; measured {seen:.3g} s ({seen / measured.step:.2f}), "
                    f"uncalibrated {raw:.3g} s ({(raw - seen) / seen:+.0%})"
                )
            cells.append(cell)
        mem = memory_bytes(shape, cluster, tokens)
        step_cell = f"{step:.3g} s" + (f" (measured {measured.step:.3g} s)" if measured else "")
        source = "measured (calibration point)" if measured else "predicted"
        lines.append(
            f"| {shape.name} | {shape.params / 1e9:.3g} B | {gpus} | {tokens} | "
            f"{_gb(sent[0])} / {_gb(sent[1])} GB | {step_cell} | {cells[0]} | {cells[1]} | "
            f"{', '.join(_gb(mem[k]) for k in ('shards', 'basis', 'whole', 'boundaries', 'block'))}"
            f"; {_gb(sum(mem.values()) - mem['basis'])} | {source} |"
        )
    return "\n".join(lines) + "\n"


#: the line after which docs/distributed.md holds :func:`table` (up to the next blank line)
TABLE_MARK = "<!-- the cost model's table: python benchmarks/cost_model.py --write-docs -->"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


def write_docs() -> None:
    """Put :func:`table` into docs/distributed.md after :data:`TABLE_MARK`."""
    page = DOCS.read_text()
    start = page.index(TABLE_MARK) + len(TABLE_MARK) + 1
    end = page.index("\n\n", start) + 1
    DOCS.write_text(page[:start] + table() + page[end:])


if __name__ == "__main__":
    if "--write-docs" in sys.argv:
        write_docs()
    sys.stdout.write(table())
    sys.stdout.write(
        f"\ncalibration: {CALIBRATION.flops_per_second / 1e12:.3g} TFLOP/s a GPU in a training "
        f"step; walk kernels {CALIBRATION.hessian_slowdown:.2f}x (Hessian) and "
        f"{CALIBRATION.ggn_slowdown:.2f}x (GGN) slower per FLOP\n"
    )
    assert math.isfinite(CALIBRATION.hessian_slowdown)
