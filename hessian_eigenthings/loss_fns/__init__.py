"""Loss helpers: supervised, HuggingFace, TransformerLens; the closed-form output-Hessian protocol."""

from hessian_eigenthings.loss_fns.huggingface import (
    HFCausalLMForward,
    HFCausalLMLoss,
    HFCausalLMPerTokenLoss,
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
    hf_seq2seq_loss,
)
from hessian_eigenthings.loss_fns.protocols import (
    CountedPerSampleLoss,
    ForwardFn,
    LossFn,
    LossOfOutputFn,
    OutputHessianLoss,
    PerSampleLossFn,
)
from hessian_eigenthings.loss_fns.standard import (
    CrossEntropyOutputLoss,
    MSEOutputLoss,
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.transformer_lens import (
    TLensLMLoss,
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
)

__all__ = [
    "CountedPerSampleLoss",
    "CrossEntropyOutputLoss",
    "ForwardFn",
    "HFCausalLMForward",
    "HFCausalLMLoss",
    "HFCausalLMPerTokenLoss",
    "LossFn",
    "LossOfOutputFn",
    "MSEOutputLoss",
    "OutputHessianLoss",
    "PerSampleLossFn",
    "TLensLMLoss",
    "cross_entropy_loss_of_output",
    "hf_lm_forward",
    "hf_lm_loss",
    "hf_lm_loss_of_output",
    "hf_lm_per_sequence_loss",
    "hf_lm_per_token_loss",
    "hf_seq2seq_loss",
    "mse_loss_of_output",
    "supervised_forward",
    "supervised_loss",
    "supervised_loss_of_output",
    "supervised_per_sample_loss",
    "tlens_forward",
    "tlens_loss",
    "tlens_loss_of_output",
]
