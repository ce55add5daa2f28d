"""One rank of the half-model FSDP2 checks (run by tests/operators/test_half_precision_policy.py).

Usage: ``python _half_precision_worker.py OUT_DIR [llama]`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. A bfloat16 MLP (or, with ``llama``, a tiny bfloat16 HF Llama), sharded with
``fully_shard``; each rank its own batches. Every rank builds the single-process reference on the
union of the ranks' batches (the same bf16 weights, unsharded, under the default float32 policy)
and compares its piece of the sharded products with its rows of the reference. Writes
``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator
from hessian_eigenthings.operators.distributed import Sharded

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CRITERION = nn.CrossEntropyLoss()


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: the same count on every rank, different sizes, bf16 inputs."""
    g = torch.Generator().manual_seed(20 + rank)
    return [
        (torch.randn(n, 4, generator=g).to(torch.bfloat16), torch.randint(0, 3, (n,), generator=g))
        for n in (3 + rank, 2 * rank + 1)
    ]


def piece(global_rows: torch.Tensor, ref: Any) -> torch.Tensor:
    """This rank's piece of global rows (NOTE [sharded vector layout]: each parameter's rows
    split by ``torch.chunk`` on dim 0, concatenated in order)."""
    out = []
    for view in ref.layout.split_rows(global_rows):
        chunks = torch.chunk(view, WORLD, dim=1)
        mine = chunks[RANK] if len(chunks) > RANK else view[:, :0]
        out.append(mine.reshape(view.shape[0], -1))
    return torch.cat(out, dim=1)


def shards(model: nn.Module) -> list[tuple[Any, ...]]:
    out = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(
            (id(p), p.dtype, local.dtype, local.data_ptr(), local._version, local.detach().clone())
        )
    return out


def unchanged(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    return all(x[:5] == y[:5] and torch.equal(x[5], y[5]) for x, y in zip(a, b, strict=True))


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {}
    try:
        if not _torch_compat.fsdp2_runs_on_cpu():
            result["skip"] = f"FSDP2 runs on CPU from torch 2.6 (this is {torch.__version__})"
            return
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.bfloat16)
        single = copy.deepcopy(model)
        model32 = copy.deepcopy(model).float()  # the same blocks, gathered in float32
        union = [b for r in range(WORLD) for b in batches(r)]
        fully_shard = _torch_compat.fully_shard()
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        for m in (model32[0], model32[2], model32):
            fully_shard(m)
        mine = batches(RANK)
        loss = supervised_loss(CRITERION)
        ref_h = HessianOperator(single, union, loss)
        ref_g = GGNOperator(single, union, supervised_forward, supervised_loss_of_output(CRITERION))
        V = torch.randn(ref_h.size, 3, generator=torch.Generator().manual_seed(5))
        ops = {
            "walk_hessian": (
                HessianOperator(
                    model, mine, loss, ranks=Sharded(model), engine="layers", layers=""
                ),
                ref_h,
            ),
            "walk_ggn": (
                GGNOperator(
                    model,
                    mine,
                    supervised_forward,
                    supervised_loss_of_output(CRITERION),
                    ranks=Sharded(model),
                    engine="layers",
                    layers="",
                ),
                ref_g,
            ),
            "functional_hessian": (
                HessianOperator(model, mine, loss, ranks=Sharded(model), engine="functional"),
                ref_h,
            ),
        }
        ops["walk_hessian_fp32_model"] = (
            HessianOperator(
                model32,
                [(x.float(), y) for x, y in mine],
                loss,
                ranks=Sharded(model32),
                engine="layers",
                layers="",
            ),
            ref_h,
        )
        # the bytes the blocks travel in (a half model's blocks are cast after the all-gather)
        sent: list[int] = []
        all_gather = _torch_compat.all_gather_single
        all_gather_async = _torch_compat.all_gather_single_async  # the walk's (prefetched) gathers

        def counted(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
            sent.append(inp.numel() * inp.element_size())
            return all_gather(out, inp, group=group)

        def counted_async(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
            sent.append(inp.numel() * inp.element_size())
            return all_gather_async(out, inp, group=group)

        _torch_compat.all_gather_single = counted  # type: ignore[assignment]
        _torch_compat.all_gather_single_async = counted_async  # type: ignore[assignment]
        for name, (op, ref) in ops.items():
            before = shards(model)
            want = piece((ref @ V).T, ref)
            sent.clear()
            got = (op @ piece(V.T, ref).T.contiguous()).T
            result[name] = {
                "sent": sum(sent),
                "dtype": str(op.dtype),
                "rel": float((got.double() - want.double()).norm() / want.double().norm()),
                "shards_unchanged": unchanged(before, shards(model)),
            }
        try:
            HessianOperator(model, mine, loss, ranks=Sharded(model), method="finite_difference")
            result["differences_refused"] = ""
        except ValueError as exc:
            result["differences_refused"] = str(exc)
    finally:
        with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
            json.dump(result, f)


# -- a tiny bf16 Llama: block arguments the model computes (rotary cos/sin, the attention mask) --
LLAMA_LAYERS = "model.layers"


def llama() -> nn.Module:
    """2 layers, hidden 16, 2 heads over 1 key/value head, vocabulary 11, eager attention; weights
    drawn wider than HF's init (std 0.3) so that attention and its rotary angles matter to the
    products, then cast to bfloat16."""
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=11,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval().to(torch.bfloat16)


def lm_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s batch: ``rank + 2`` rows of 6 tokens, the last row padded after 4 + rank."""
    g = torch.Generator().manual_seed(40 + rank)
    ids = torch.randint(0, 11, (rank + 2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, 4 + rank :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def lm_logits(m: nn.Module, b: Any) -> torch.Tensor:
    out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    return out.logits[:, :-1].reshape(-1, out.logits.shape[-1])


def lm_loss(m: nn.Module, b: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(lm_logits(m, b), b["input_ids"][:, 1:].reshape(-1))


def lm_decay_loss(m: nn.Module, b: Any) -> torch.Tensor:
    """The loss plus a weight decay on the head, read after the model's call."""
    return lm_loss(m, b) + 0.01 * m.lm_head.weight.square().sum()


def lm_pair(rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The batch and its next-token targets (the GGN's data)."""
    b = lm_batch(rank)
    return b, b["input_ids"][:, 1:].reshape(-1)


def whole_elements(model: nn.Module, slots: list[tuple[nn.Module, str]]) -> int:
    """Elements of the parameters the model's ``slots`` hold whole (not as FSDP's sharded
    DTensors) now, a slot swapped for a plain attribute (``torch.func.functional_call``)
    included."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for m, name in slots:
        t = getattr(m, name)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            seen[id(t)] = t.numel()
    return sum(seen.values())


def main_llama(out_dir: str) -> None:
    """The sharded layer walk (Hessian and GGN) and the gathered functional product of a bf16
    Llama under the default policy against the single-process default product on the union of
    the ranks' batches; that reference against the float64 product of the same weights; the
    shards left as found; the whole parameters a rank holds during a product; ``precision="model"``
    products saved (``model{r}.pt``) to compare across versions."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result: dict[str, Any] = {}
    try:
        if not _torch_compat.fsdp2_runs_on_cpu():
            result["skip"] = f"FSDP2 runs on CPU from torch 2.6 (this is {torch.__version__})"
            return
        try:
            import transformers  # noqa: F401
        except ImportError:
            result["skip"] = "needs transformers"
            return
        model = llama()
        single, model64 = copy.deepcopy(model), copy.deepcopy(model).double()
        fully_shard = _torch_compat.fully_shard()
        for block in model.get_submodule(LLAMA_LAYERS):
            fully_shard(block)
        fully_shard(model)
        union = [lm_batch(r) for r in range(WORLD)]
        pairs = [lm_pair(r) for r in range(WORLD)]
        loss_of_output = supervised_loss_of_output(CRITERION)
        ref_h = HessianOperator(single, union, lm_loss)
        ref_g = GGNOperator(single, pairs, lambda m, b: lm_logits(m, b[0]), loss_of_output)
        ref64_h = HessianOperator(model64, union, lm_loss)
        ref64_g = GGNOperator(model64, pairs, lambda m, b: lm_logits(m, b[0]), loss_of_output)
        V = torch.randn(ref_h.size, 2, generator=torch.Generator().manual_seed(8))
        want_h, want_g = ref_h @ V, ref_g @ V
        result["reference_dtype"] = str(ref_h.dtype)
        result["reference_vs_float64"] = {
            "hessian": float((want_h.double() - ref64_h @ V.double()).norm() / want_h.norm()),
            "ggn": float((want_g.double() - ref64_g @ V.double()).norm() / want_g.norm()),
        }

        def sharded(**options: Any) -> dict[str, Any]:
            return {"ranks": Sharded(model), **options}

        walk = {"engine": "layers", "layers": LLAMA_LAYERS}
        mine, mine_pair = [lm_batch(RANK)], [lm_pair(RANK)]
        forward = lambda m, b: lm_logits(m, b[0])  # noqa: E731
        ops = {
            "walk_hessian": (HessianOperator(model, mine, lm_loss, **sharded(**walk)), want_h),
            "walk_ggn": (
                GGNOperator(model, mine_pair, forward, loss_of_output, **sharded(**walk)),
                want_g,
            ),
            "functional_hessian": (
                HessianOperator(model, mine, lm_loss, **sharded(engine="functional")),
                want_h,
            ),
            "functional_ggn": (
                GGNOperator(
                    model, mine_pair, forward, loss_of_output, **sharded(engine="functional")
                ),
                want_g,
            ),
        }
        # the most parameter elements the model's slots hold whole while a layer runs
        held = [0]
        slots = [(m, name) for m in model.modules() for name in m._parameters]

        def count(module: nn.Module, args: Any, out: Any) -> None:
            held[0] = max(held[0], whole_elements(model, slots))

        # on each layer's MLP: a plain module inside the layer's call (the walk sets FSDP's
        # modules' hooks aside)
        handles = [b.mlp.register_forward_hook(count) for b in model.get_submodule(LLAMA_LAYERS)]
        for name, (op, want) in ops.items():
            before = shards(model)
            held[0] = 0
            got = (op @ piece(V.T, ref_h).T.contiguous()).T
            mine_want = piece(want.T, ref_h)
            result[name] = {
                "dtype": str(op.dtype),
                "rel": float(
                    (got.double() - mine_want.double()).norm() / mine_want.double().norm()
                ),
                "shards_unchanged": unchanged(before, shards(model)),
                "held": held[0],
            }
        for h in handles:
            h.remove()

        # a loss that reads a root parameter after the model's call: it is whole there, as FSDP
        # leaves it after its forward (no DTensor arithmetic, which would warn)
        ref_decay = HessianOperator(single, union, lm_decay_loss)
        want = piece((ref_decay @ V).T, ref_h)
        op = HessianOperator(model, mine, lm_decay_loss, **sharded(**walk))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = (op @ piece(V.T, ref_h).T.contiguous()).T
        result["walk_hessian_decay"] = {
            "rel": float((got.double() - want.double()).norm() / want.double().norm()),
            "warnings": [str(c.message)[:200] for c in caught],
        }

        # a loss that raises in the middle of the recording forward (after the first layer ran
        # with its parameters whole), on every rank: it raises, and the model is as found
        def boom(module: nn.Module, args: Any, out: Any) -> None:
            raise RuntimeError("boom")

        before = shards(model)
        handle = model.get_submodule(LLAMA_LAYERS)[1].mlp.register_forward_hook(boom)
        try:
            ops["walk_hessian"][0] @ piece(V.T, ref_h).T.contiguous()
            result["raised"] = ""
        except RuntimeError as exc:
            result["raised"] = str(exc)
        finally:
            handle.remove()
        result["raised_shards_unchanged"] = unchanged(before, shards(model))
        sizes = {
            name: sum(p.numel() for p in m.parameters())
            for name, m in [("model", single), *single.model.layers.named_children()]
        }
        result["elements"] = {"model": sizes["model"], "layer": max(sizes["0"], sizes["1"])}
        result["elements"]["outside"] = sizes["model"] - sizes["0"] - sizes["1"]
        # products in the model's own dtype: kept as they were
        saved = {}
        for name, op in (
            (
                "walk_hessian",
                HessianOperator(model, mine, lm_loss, precision="model", **sharded(**walk)),
            ),
            (
                "walk_ggn",
                GGNOperator(
                    model, mine_pair, forward, loss_of_output, precision="model", **sharded(**walk)
                ),
            ),
        ):
            got = (op @ piece(V.T, ref_h).T.to(torch.bfloat16).contiguous()).T
            saved[name] = got
            want = piece((want_h if name == "walk_hessian" else want_g).T, ref_h)
            result[f"model_{name}"] = {
                "dtype": str(op.dtype),
                "rel": float((got.double() - want.double()).norm() / want.double().norm()),
            }
        torch.save(saved, os.path.join(out_dir, f"model{RANK}.pt"))
    finally:
        with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[2:] == ["llama"]:
        main_llama(sys.argv[1])
    else:
        main(sys.argv[1])
    # NOTE [worker exits without the gloo teardown] (_dist_checks.py): the results are on disk
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
