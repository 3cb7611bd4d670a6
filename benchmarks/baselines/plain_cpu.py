"""CPU baseline: the plain-PyTorch baseline of plain_gpu.py, one fp32 training step, on the CPU.

The plain-PyTorch baseline docs/benchmarks.md measures dlm against (`python -m benchmarks train-step` steps it);
deliberately kept simple and left unoptimised by dlm: it defines the figure.

usage: plain_cpu.py [d_model layers heads seq batch vocab]   prints tokens/s and model GFLOP/s
(model FLOPs per token = 6 * params + 12 * layers * d_model * seq, the same count used on the GPU).
"""

import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import plain_gpu as a

d, layers, heads, seq, batch, vocab = (int(x) for x in (sys.argv[1:] or [256, 4, 4, 256, 8, 8192]))
torch.manual_seed(0)
model = a.Baseline(vocab, d, layers, heads, seq)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
clean = torch.randint(0, vocab - 1, (batch, seq))


def step():
    loss = a.diffusion_loss(model, clean, vocab - 1)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(3):
    step()
times = []
for _ in range(10):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
t = sorted(times)[len(times) // 2]
n = sum(p.numel() for p in model.parameters())
flops = (6 * n + 12 * layers * d * seq) * batch * seq
print(f"params={n} tokens/s={batch * seq / t:.0f} model_GFLOP/s={flops / t / 1e9:.1f} step_s={t:.3f}")
