"""The layer walk (NOTE [layer walk]): exact Hessian products one layer at a time, against dense
float64 Hessians and the whole-graph products, on a stack of layers, HF GPT-2 (tied
embeddings, padded rows) and HF Llama (tied and untied); and its refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators.layer_walk import LayerWalk, LayerWalkError
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian

SUP = supervised_loss(nn.CrossEntropyLoss())


def _walk_product(walk: LayerWalk, op: Any, batch: Any, v: torch.Tensor) -> torch.Tensor:
    vs = dict(zip(op.layout.names, [t[0] for t in op.layout.split_rows(v[None])], strict=True))
    out = walk.hvp(walk.capture(batch), vs)
    return torch.cat([out[n].reshape(-1) for n in op.layout.names])


def test_a_stack_of_layers_matches_the_dense_hessian() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))]
    op = he.HessianOperator(model, data, SUP)
    walk = LayerWalk(model, SUP, op.layout.names, "")  # the Sequential's own children
    H = dense_hessian(model, data, SUP, select_parameters(model))
    for seed in range(3):
        v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(
            _walk_product(walk, op, data[0], v), H @ v, rtol=1e-12, atol=1e-14
        )
    # the model is as it was: no hooks, no instance forwards left behind
    assert all("forward" not in m.__dict__ for m in model)
    assert all(not m._forward_hooks and not m._forward_hooks_with_kwargs for m in model)


def _lm(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), b["input_ids"][:, 1:].reshape(-1)
    )


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    torch.manual_seed(0)
    return (
        transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").double().eval()
    )


def _llama(tied: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return (
        transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").double().eval()
    )


def test_hf_gpt2_with_tied_embeddings_and_padding_matches_the_whole_graph_product() -> None:
    model, batch = _gpt2(), _lm_batch()
    assert model.lm_head.weight is model.transformer.wte.weight
    op = he.HessianOperator(model, [batch], _lm, engine="autograd")
    walk = LayerWalk(model, _lm, op.layout.names, "transformer.h")
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = op @ v
    got = _walk_product(walk, op, batch, v)
    assert float((got - ref).norm() / ref.norm()) <= 1e-10


@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_matches_the_forward_over_reverse_product(tied: bool) -> None:
    # Llama's eager attention takes its softmax in float32 even for a float64 model: the
    # reverse-over-reverse and forward-over-reverse products then differ by about 5e-8 (the
    # rounding of that softmax, differentiated two ways). The walk is forward-over-reverse per
    # layer: it is checked against the whole-graph forward-over-reverse product (the
    # functional engine), and against autograd's within that rounding.
    model, batch = _llama(tied), _lm_batch()
    op = he.HessianOperator(model, [batch], _lm, engine="functional")
    walk = LayerWalk(model, _lm, op.layout.names, "model.layers")
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = op @ v
    got = _walk_product(walk, op, batch, v)
    assert float((got - ref).norm() / ref.norm()) <= 1e-10
    auto = he.HessianOperator(model, [batch], _lm, engine="autograd") @ v
    assert float((got - auto).norm() / auto.norm()) <= 1e-6


@pytest.mark.parametrize("kept", [1, 2])
@pytest.mark.parametrize("kind", ["stack", "gpt2", "llama"])
def test_kept_layer_graphs_give_the_same_product(kind: str, kept: int) -> None:
    """NOTE [kept layer graphs]: layers whose jvp's graph is kept from the forward walk (reverse
    over forward) give the product of the recomputing walk (forward over reverse) to rounding,
    and the walk counts them."""
    if kind == "stack":
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)
        ).double()
        batch: Any = (torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
        loss, layers = SUP, ""
    else:
        model, batch, loss = (_gpt2() if kind == "gpt2" else _llama(True)), _lm_batch(), _lm
        layers = "transformer.h" if kind == "gpt2" else "model.layers"
    op = he.HessianOperator(model, [batch], loss, engine="functional")
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = op @ v
    plain = LayerWalk(model, loss, op.layout.names, layers, keep_bytes=0)
    walk = LayerWalk(model, loss, op.layout.names, layers, keep_bytes=kept)
    got, base = _walk_product(walk, op, batch, v), _walk_product(plain, op, batch, v)
    assert walk.kept_layers == min(kept, len(walk.layers)) and plain.kept_layers == 0
    assert float((base - ref).norm() / ref.norm()) <= 1e-10
    # Llama's float32 softmax: reverse over forward and forward over reverse differ by its
    # rounding (see the test above); elsewhere both are float64 throughout
    tol = 1e-6 if kind == "llama" else 1e-10
    assert float((got - ref).norm() / ref.norm()) <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_layer_graphs_by_default_on_cuda() -> None:
    """NOTE [kept layer graphs] on CUDA by default: the first product keeps nothing (it measures
    the walk's working set), the next ones keep what fits (here every layer), same products."""
    model, batch = _gpt2().cuda(), {k: t.cuda() for k, t in _lm_batch().items()}
    op = he.HessianOperator(model, [batch], _lm, engine="functional")
    walk = LayerWalk(model, _lm, op.layout.names, "transformer.h")
    v = torch.randn(op.size, dtype=torch.float64, device="cuda")
    ref = op @ v
    kept = []
    for _ in range(3):
        got = _walk_product(walk, op, batch, v)
        assert float((got - ref).norm() / ref.norm()) <= 1e-10
        kept.append(walk.kept_layers)
    assert kept == [0, len(walk.layers), len(walk.layers)], kept


class _NativeNorm(nn.Module):
    """A layer calling torch.layer_norm itself: its forward-mode formula does not differentiate in
    reverse, and the mode that swaps F.layer_norm does not see this call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.layer_norm(self.lin(x), (4,)))


def test_a_kept_layer_that_disagrees_turns_keeping_off() -> None:
    """NOTE [kept layer graphs]: the first kept layer is checked against the recomputed walk;
    one that disagrees (here: a native layer_norm's reverse-over-forward) makes the walk recompute,
    the product stays exact, and the walk says why."""
    torch.manual_seed(0)
    model = nn.Sequential(_NativeNorm(), _NativeNorm(), nn.Linear(4, 3)).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))]
    op = he.HessianOperator(model, data, SUP)
    H = dense_hessian(model, data, SUP, select_parameters(model))
    walk = LayerWalk(model, SUP, op.layout.names, "", keep_bytes=2)
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        torch.testing.assert_close(
            _walk_product(walk, op, data[0], v), H @ v, rtol=1e-10, atol=1e-12
        )
    assert walk.keep_refused is not None and "differed" in walk.keep_refused
    assert walk.kept_layers == 0  # the second product kept nothing


class _Skip(nn.Module):
    """Not a stack: the second layer reads the model's input, not the first layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](x) + self.layers[1](x))


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.head = nn.Linear(3, 3)
        self.head.weight = self.layers[0].weight  # shared between a layer and the head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[1](self.layers[0](x)))


def test_what_cannot_be_walked_is_refused() -> None:
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    model = _Skip()
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(LayerWalkError, match="not layer 0's output"):
        LayerWalk(model, SUP, names, "layers").capture(data)
    with pytest.raises(LayerWalkError, match=r"nn\.ModuleList or nn\.Sequential"):
        LayerWalk(model, SUP, names, "head")
    with pytest.raises(LayerWalkError, match="no such submodule"):
        LayerWalk(model, SUP, names, "blocks")
    dropping = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 2))  # training mode
    with pytest.raises(ValueError, match="dropout"):
        LayerWalk(dropping, SUP, [n for n, _ in dropping.named_parameters()], "").capture(data)
    shared = _Shared()
    with pytest.raises(LayerWalkError, match="shared between a layer"):
        LayerWalk(shared, SUP, [n for n, _ in shared.named_parameters()], "layers")


def test_engine_layers_on_the_hessian_operator() -> None:
    """``HessianOperator(..., engine="layers", layers=...)``: the data loop, batch weighting,
    blocks and kept states of any engine, the walk for each batch's products."""
    model = _gpt2()
    batches = [_lm_batch(), {k: t[:1] for k, t in _lm_batch().items()}]  # uneven batch sizes
    walked = he.HessianOperator(model, batches, _lm, engine="layers", layers="transformer.h")
    whole = he.HessianOperator(model, batches, _lm, engine="autograd")
    V = torch.randn(walked.size, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = whole @ V
    got = walked @ V
    assert float((got - ref).norm() / ref.norm()) <= 1e-10
    assert walked.engine == "layers" and walked.engine_report["layers"] == 2
    forwards = walked.num_forwards
    walked @ V[:, 0]  # kept states: no new capture
    assert walked.num_forwards == forwards
    with pytest.raises(LayerWalkError, match="no such submodule"):
        he.HessianOperator(model, batches, _lm, engine="layers", layers="transformer.blocks")
    with pytest.raises(ValueError, match="layers= applies to it only"):
        he.HessianOperator(model, batches, _lm, engine="layers")
    with pytest.raises(ValueError, match="layers= applies to it only"):
        he.HessianOperator(model, batches, _lm, layers="transformer.h")
    from tests.operators.toy_curvature import BatchGradientOuterProduct

    with pytest.raises(ValueError, match="no layer walk"):
        BatchGradientOuterProduct(
            nn.Sequential(nn.Linear(3, 2)),
            [(torch.randn(4, 3), torch.randint(0, 2, (4,)))],
            SUP,
            engine="layers",
            layers="",
        )


def _lm_forward(m: nn.Module, b: Any) -> torch.Tensor:
    batch = b[0]  # (the batch, its next-token targets)
    logits = m(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    return logits[:, :-1].reshape(-1, logits.shape[-1])


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"mc_samples": 1, "seed": 3}, {"mc_samples": 2, "seed": 3}],
    ids=["exact", "mc1", "mc2"],
)
def test_the_ggn_walk_matches_the_whole_graph_ggn(kwargs: dict[str, Any]) -> None:
    """``Jᵀ H J v`` one layer at a time on HF GPT-2 (tied embeddings, padded rows), exact and
    Monte-Carlo (the same draws for one seed on either engine)."""
    from hessian_eigenthings.loss_fns import supervised_loss_of_output

    model = _gpt2()
    batches = [_lm_batch(), {k: t[:1] for k, t in _lm_batch().items()}]
    data = [(b, b["input_ids"][:, 1:].reshape(-1)) for b in batches]
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    walked = he.GGNOperator(
        model, data, _lm_forward, loss, engine="layers", layers="transformer.h", **kwargs
    )
    whole = he.GGNOperator(model, data, _lm_forward, loss, engine="autograd", **kwargs)
    V = torch.randn(walked.size, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref = whole @ V
    got = walked @ V
    assert float((got - ref).norm() / ref.norm()) <= 1e-10


def test_the_empirical_fisher_walk_matches_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(2)]
    per_sample = he.supervised_per_sample_loss(nn.CrossEntropyLoss(reduction="none"))
    walked = he.EmpiricalFisherOperator(model, data, per_sample, engine="layers", layers="")
    whole = he.EmpiricalFisherOperator(model, data, per_sample, engine="autograd")
    V = torch.randn(walked.size, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(walked @ V, whole @ V, rtol=1e-10, atol=1e-12)


def test_a_key_value_cache_is_not_replayed() -> None:
    """NOTE [key/value caches]: with HF's default use_cache=True the layers get a cache they
    append to; the walk records it as None (it was empty), with the same product. A cache that
    already held tokens is refused."""
    model, batch = _gpt2(), _lm_batch()

    def cached(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(input_ids=b["input_ids"], labels=b["input_ids"]).loss  # use_cache: the default

    # HF's loss takes the logits to float32: compared with the forward-over-reverse product (as
    # for Llama above), which rounds the same way
    op = he.HessianOperator(model, [batch], cached, engine="functional")
    walk = LayerWalk(model, cached, op.layout.names, "transformer.h")
    v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ref = op @ v
    assert float((_walk_product(walk, op, batch, v) - ref).norm() / ref.norm()) <= 1e-10
    with torch.no_grad():
        past = model(input_ids=batch["input_ids"][:, :3], use_cache=True).past_key_values

    def with_past(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out = m(input_ids=b["input_ids"][:, 3:], past_key_values=copy.deepcopy(past))
        return out.logits.square().mean()

    with pytest.raises(LayerWalkError, match="already held tokens"):
        LayerWalk(model, with_past, op.layout.names, "transformer.h").capture(batch)


def test_hooks_on_the_layers_run_once() -> None:
    """NOTE [hooks on the layers]: a forward hook that adds a steering vector to a block's
    output and a pre-hook that scales a block's input act once, as in the whole-graph product;
    the hooks are in place afterwards."""
    model, batch = _gpt2(), _lm_batch()
    steer = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    blocks = model.transformer.h

    def add_steering(module: nn.Module, args: Any, out: Any) -> Any:
        return out + steer if isinstance(out, torch.Tensor) else (out[0] + steer, *out[1:])

    def scale_input(module: nn.Module, args: Any) -> Any:
        return (args[0] * 1.5, *args[1:])

    handles = [
        blocks[0].register_forward_hook(add_steering),
        blocks[1].register_forward_pre_hook(scale_input),
    ]
    try:
        op = he.HessianOperator(model, [batch], _lm, engine="autograd")
        walk = LayerWalk(model, _lm, op.layout.names, "transformer.h")
        v = torch.randn(op.size, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
        ref = op @ v
        assert float((_walk_product(walk, op, batch, v) - ref).norm() / ref.norm()) <= 1e-10
        assert len(blocks[0]._forward_hooks) == 1 and len(blocks[1]._forward_pre_hooks) == 1
    finally:
        for h in handles:
            h.remove()


class _SharedBias(nn.Module):
    """Each block also receives a learned tensor: not a constant, so not walkable."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(3))
        self.blocks = nn.ModuleList([_AddLinear(), _AddLinear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, self.bias * 2)
        return x


class _AddLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + extra)


def test_a_parameter_dependent_argument_of_a_block_is_refused() -> None:
    model = _SharedBias()
    data = (torch.randn(4, 3), torch.randint(0, 3, (4,)))
    walk = LayerWalk(model, SUP, [n for n, _ in model.named_parameters()], "blocks")
    with pytest.raises(LayerWalkError, match="depends on the parameters"):
        walk.capture(data)
