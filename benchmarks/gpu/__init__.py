"""The GPU check's measurements (scripts/gpu_check.sh runs them): plain-PyTorch baselines and dlm side by side.

Each part is its own subcommand and process, appending every figure to a JSON-lines file (`--out`) the
moment it exists, so a part cut off by the check's timeout keeps what it measured; `gpu-report` then
reads those lines (with pytest's summary and the parts' exit codes) and writes the result file
`gpu.json` through the harness, with the targets met or missed, and a Markdown table.

- `gpu-throughput` (`throughput.py`): dlm's training step against the compiled plain-PyTorch baseline
  (benchmarks/baselines/plain_gpu.py) at ~110M and ~1.3B, against the measured bf16 matmul ceiling.
- `gpu-quality` (`quality.py`): bits per byte on held-out Shakespeare after a minute of training, dlm
  and its autoregressive twin, optionally the baseline MDM (benchmarks/baselines/quality_gpu.py).
- `gpu-generate` (`quality.py`): the sampler settings of the quality part's model, judged by its twin.
- `gpu-report` (`report.py`): the targets and tables.
`load-memory` (benchmarks/load_memory.py) measures the 8B load and LoRA step into the same lines.
"""
