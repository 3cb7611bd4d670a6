"""GPU baselines for masked-diffusion LM training throughput.

The plain-PyTorch baseline docs/benchmarks.md measures dlm against (`python -m benchmarks
train-step` and the GPU benchmark import it); deliberately kept simple and left unoptimised by dlm:
it defines the figure.

Measures, in one process on one GPU:
  * the bf16 matmul ceiling (8192^3 on random data),
  * a plain-PyTorch bidirectional transformer trained with the masked-diffusion
    loss (the baseline a competent engineer writes in an afternoon: SDPA, bf16
    autocast, fused AdamW, optionally torch.compile),
  * Hugging Face ModernBERT (masked LM head) with the same loss, the model a
    user would most likely pick off the shelf.
Prints one JSON line per measurement and a table last.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return times[len(times) // 2]


def matmul_ceiling() -> float:
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    t = timed(lambda: a @ b, 3, 10)
    return 2 * n**3 / t / 1e12


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Baseline(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx, positions=None):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)
        if positions is not None:
            x = x[positions]
        return x @ self.tok.weight.t()


def diffusion_loss(logits_fn, clean, mask_id, eps=1e-3, sparse=True):
    b, t = clean.shape
    p = eps + (1 - eps) * torch.rand(b, 1, device=clean.device)
    mask = torch.rand(b, t, device=clean.device) < p
    noisy = torch.where(mask, torch.full_like(clean, mask_id), clean)
    if sparse:
        logits = logits_fn(noisy, mask)
        ce = F.cross_entropy(logits.float(), clean[mask], reduction="none")
        w = (1 / p).expand(b, t)[mask]
        return (ce * w).sum() / (b * t)
    logits = logits_fn(noisy, None)
    ce = F.cross_entropy(logits.float().view(b * t, -1), clean.view(-1), reduction="none").view(b, t)
    return (ce * mask / p).sum() / (b * t)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def run_case(name, model, step_logits, cfg, batch, compile_model, sparse):
    vocab, d, layers, _heads, seq = cfg
    model = model.to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fn = torch.compile(step_logits) if compile_model else step_logits
    clean = torch.randint(0, vocab - 1, (batch, seq), device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = diffusion_loss(fn, clean, vocab - 1, sparse=sparse)
        loss.backward()
        opt.step()  # noqa: F821 (bound in run_case; deleted only after the last step)
        opt.zero_grad(set_to_none=True)  # noqa: F821

    torch.cuda.reset_peak_memory_stats()
    t = timed(step, 5, 15)
    tokens = batch * seq
    n = n_params(model)
    flops_per_token = 6 * n + 12 * layers * d * seq
    tflops = flops_per_token * tokens / t / 1e12
    rec = {
        "case": name,
        "params_M": round(n / 1e6, 1),
        "batch": batch,
        "seq": seq,
        "compile": compile_model,
        "sparse_head": sparse,
        "tokens_per_s": round(tokens / t),
        "model_tflops": round(tflops, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print(json.dumps(rec), flush=True)
    del opt, model
    torch.cuda.empty_cache()
    return rec


def modernbert(cfg):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    vocab, d, layers, heads, seq = cfg
    mcfg = ModernBertConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=int(d * 8 / 3) // 64 * 64 * 2 // 2,
        max_position_embeddings=seq,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        attn_implementation="sdpa",
    )
    model = ModernBertForMaskedLM(mcfg)

    def logits_fn(noisy, mask):
        return model(input_ids=noisy).logits if mask is None else model(input_ids=noisy).logits[mask]

    return model, logits_fn


def main():
    out = []
    peak = matmul_ceiling()
    print(json.dumps({"case": "matmul_bf16_8192", "tflops": round(peak, 1)}), flush=True)
    configs = {
        "110M": ((32768, 768, 12, 12, 1024), 32),
        "1.3B": ((32768, 2048, 24, 16, 1024), 8),
    }
    for size, (cfg, batch) in configs.items():
        vocab, d, layers, heads, seq = cfg
        for compile_model in (False, True):
            torch.manual_seed(0)
            model = Baseline(vocab, d, layers, heads, seq)
            rec = run_case(f"baseline-{size}", model, model, cfg, batch, compile_model, True)
            rec["mfu_pct"] = round(100 * rec["model_tflops"] / peak, 1)
            out.append(rec)
        try:
            torch.manual_seed(0)
            model, fn = modernbert(cfg)
            rec = run_case(f"modernbert-{size}", model, fn, cfg, batch, False, True)
            rec["mfu_pct"] = round(100 * rec["model_tflops"] / peak, 1)
            out.append(rec)
        except Exception as exc:
            print(json.dumps({"case": f"modernbert-{size}", "error": repr(exc)[:300]}), flush=True)
    print(f"matmul ceiling {peak:.0f} TFLOP/s; torch {torch.__version__}")
    print(f"{'case':<18}{'params':>8}{'compile':>8}{'tok/s':>12}{'TFLOP/s':>9}{'MFU%':>6}{'GiB':>7}")
    for r in out:
        print(
            f"{r['case']:<18}{r['params_M']:>8}{r['compile']!s:>8}{r['tokens_per_s']:>12}"
            f"{r['model_tflops']:>9}{r['mfu_pct']:>6}{r['peak_gib']:>7}"
        )


if __name__ == "__main__":
    sys.exit(main())
