import sys, traceback, torch
from benchmarks.workloads import gpt2
from transformers import GPT2Config, GPT2LMHeadModel
cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=50257, n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").cuda().eval()
ids = torch.randint(0, 50257, (4, 128), device="cuda")
import hessian_eigenthings as he
op = he.HessianOperator(model, [{"input_ids": ids}], he.hf_lm_loss(), graph_reuse=False)
v = torch.randn(op.size, device="cuda")
import warnings
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    for _ in range(4):
        op @ v
print("sdpa GPT-2 replays", op.num_replays, [str(w.message)[:300] for w in ws])
