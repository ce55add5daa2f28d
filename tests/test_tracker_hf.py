"""HessianTrackerCallback in a HuggingFace Trainer (tiny GPT-2 from a config, CPU, no downloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hessian_eigenthings.algorithms import lanczos
from hessian_eigenthings.loss_fns.huggingface import hf_lm_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.tracking import CurvatureTracker
from hessian_eigenthings.tracking_hf import HessianTrackerCallback

g = torch.Generator().manual_seed(0)
DATA = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (16, 8), generator=g)]
PROBE = {"input_ids": torch.randint(0, 32, (4, 8), generator=g)}


OPTS: dict = {}


def _run(tmp_path, track: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)  # dropout 0.1: the training forwards draw masks
    args = TrainingArguments(
        output_dir=str(tmp_path / ("t" if track else "p")),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=DATA)
    tracker = None
    if track:
        tracker = CurvatureTracker(model, hf_lm_loss(), batch=PROBE, every=2, k=1, **OPTS)
        trainer.add_callback(HessianTrackerCallback(tracker))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return model, tracker, trainer, losses


def test_hf_trainer_callback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, _, _, plain_losses = _run(tmp_path, track=False)
    model, tracker, trainer, losses = _run(tmp_path, track=True)
    assert tracker is not None
    assert losses == plain_losses and len(losses) == 4  # training untouched
    assert [r.step for r in tracker.history] == [2, 4]
    logged = [e for e in trainer.state.log_history if "sharpness" in e]
    assert [e["step"] for e in logged] == [2, 4]
    model.eval()
    cold = lanczos(HessianOperator(model, [PROBE], hf_lm_loss()), k=1, which="LA", seed=1)
    # NOTE [updates that keep the version]: the Trainer's fused AdamW leaves version counters alone
    np.testing.assert_allclose(tracker.history[-1].eigenvalues, cold.eigenvalues.numpy(), rtol=1e-5)
