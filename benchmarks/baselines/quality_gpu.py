"""Quality baseline: best validation bits/byte reached in a fixed wall-clock budget on one GPU,
for a plain masked-diffusion transformer (ELBO) and the same network trained autoregressively.

Data: bench/qdata/shakespeare.npz (39 plays train; hamlet, macbeth, twelfth night validation;
byte-level BPE 8192; built by make_quality_data.py). usage: quality_gpu.py [seconds_per_model] [device]

The plain-PyTorch baseline docs/benchmarks.md measures dlm's quality against (`python -m benchmarks
gpu-quality --baseline` imports it); deliberately kept simple and left unoptimised by dlm: it defines the figure.
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
DEV = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
D, LAYERS, HEADS, SEQ, BATCH = 384, 6, 6, 256, 64
PEAK_LR, WARMUP, WD = 2e-3, 200, 0.1
EVAL_EVERY = 10.0
ROPE = __import__("os").environ.get("QROPE", "1") == "1"  # learned absolute positions stall the MDM

data = np.load("bench/qdata/shakespeare.npz")
VOCAB, MASK = int(data["vocab"]), int(data["mask"])
train = torch.from_numpy(data["train"].astype(np.int64))
val = torch.from_numpy(data["val"].astype(np.int64))
VAL_BYTES = int(data["val_bytes"])
val_blocks = val[: (val.numel() // SEQ) * SEQ].view(-1, SEQ)
val_blocks = val_blocks[: int(__import__("os").environ.get("QVAL_BLOCKS", "100000"))].to(DEV)
VAL_TOKENS = val_blocks.numel()
VAL_BYTES = VAL_BYTES * VAL_TOKENS // val.numel()  # bytes of the evaluated share


def rotary(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rope_tables(seq, head_dim, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


ROPE_TABLES = rope_tables(SEQ, D // HEADS)


class Block(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        if ROPE:
            cos, sin = ROPE_TABLES[0][:t].to(x.device), ROPE_TABLES[1][:t].to(x.device)
            q, k = rotary(q, cos, sin).type_as(v), rotary(k, cos, sin).type_as(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Net(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(causal) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        for blk in self.blocks:
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * LAYERS))
            nn.init.normal_(blk.out.weight, std=0.02 / math.sqrt(2 * LAYERS))

    def forward(self, idx, positions=None):
        x = self.tok(idx) if ROPE else self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)
        if positions is not None:
            x = x[positions]
        return x @ self.tok.weight.t()


def batch(gen):
    starts = torch.randint(0, train.numel() - SEQ - 1, (BATCH,), generator=gen)
    rows = torch.stack([train[s : s + SEQ + 1] for s in starts.tolist()])
    return rows.to(DEV, non_blocking=True)


def mdm_loss(model, rows, gen=None):
    x = rows[:, :SEQ]
    p = 1e-3 + (1 - 1e-3) * torch.rand(x.shape[0], 1, device=DEV, generator=gen)
    m = torch.rand(x.shape, device=DEV, generator=gen) < p
    noisy = torch.where(m, torch.full_like(x, MASK), x)
    logits = model(noisy, m)
    ce = F.cross_entropy(logits.float(), x[m], reduction="none")
    return (ce / p.expand_as(x)[m]).sum() / x.numel()


def ar_loss(model, rows):
    logits = model(rows[:, :SEQ])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), rows[:, 1 : SEQ + 1].reshape(-1))


@torch.no_grad()
def evaluate(model, kind):
    model.eval()
    gen = torch.Generator(device=DEV).manual_seed(0)
    total = 0.0
    for x in val_blocks.split(64):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=DEV.type == "cuda"):
            if kind == "ar":
                logits = model(x[:, :-1])
                summed = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum")
                total += float(summed) / (SEQ - 1) * SEQ
            else:
                k_samples = 8
                u0 = torch.rand(x.shape[0], 1, device=DEV, generator=gen)
                for k in range(k_samples):
                    t = 1e-3 + (1 - 1e-3) * ((u0 + k / k_samples) % 1.0)
                    m = torch.rand(x.shape, device=DEV, generator=gen) < t
                    noisy = torch.where(m, torch.full_like(x, MASK), x)
                    logits = model(noisy, m)
                    ce = F.cross_entropy(logits.float(), x[m], reduction="none")
                    total += float((ce / t.expand_as(x)[m]).sum()) / k_samples
    model.train()
    nats_per_token = total / VAL_TOKENS
    return nats_per_token, nats_per_token * VAL_TOKENS / VAL_BYTES / math.log(2)


def run(kind):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = Net(causal=kind == "ar").to(DEV)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        fused=DEV.type == "cuda",
    )
    loss_fn = ar_loss if kind == "ar" else mdm_loss
    step_fn = torch.compile(loss_fn) if DEV.type == "cuda" else loss_fn

    def step(i, elapsed):
        lr = PEAK_LR * min(1.0, (i + 1) / WARMUP) * max(0.05, 1 - elapsed / SECONDS)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=DEV.type == "cuda"):
            loss = step_fn(model, batch(gen))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step(0, 0.0)  # compile outside the budget
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    next_eval, i, best = EVAL_EVERY, 1, (float("inf"), float("inf"), 0.0, 0)
    curve = []
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= SECONDS:
            break
        step(i, elapsed)
        i += 1
        if elapsed >= next_eval:
            nats, bpb = evaluate(model, kind)
            curve.append((round(elapsed, 1), round(bpb, 4)))
            if bpb < best[1]:
                best = (nats, bpb, elapsed, i)
            next_eval += EVAL_EVERY
    nats, bpb = evaluate(model, kind)
    if bpb < best[1]:
        best = (nats, bpb, SECONDS, i)
    tokens = i * BATCH * SEQ
    rec = {
        "kind": kind,
        "seconds": SECONDS,
        "steps": i,
        "train_tokens": tokens,
        "epochs": round(tokens / train.numel(), 1),
        "final_bpb": round(bpb, 4),
        "best_bpb": round(best[1], 4),
        "best_nats_per_token": round(best[0], 4),
        "best_at_s": round(best[2], 1),
        "curve": curve,
    }
    print(json.dumps(rec), flush=True)
    return rec


def unigram_bpb():
    counts = torch.bincount(train, minlength=VOCAB).double() + 1
    logp = (counts / counts.sum()).log()
    nats = float(-logp[val_blocks.flatten().cpu()].mean())
    return nats * VAL_TOKENS / VAL_BYTES / math.log(2)


if __name__ == "__main__":
    print(json.dumps({"unigram_bpb": round(unigram_bpb(), 4), "val_tokens": VAL_TOKENS, "val_bytes": VAL_BYTES}))
    results = [run("mdm"), run("ar")]
    for r in results:
        print(
            f"{r['kind']}: best {r['best_bpb']} bits/byte at {r['best_at_s']} s, final {r['final_bpb']}, "
            f"{r['steps']} steps, {r['epochs']} epochs"
        )
