#!/usr/bin/env bash
# Issue #7's GPU checks, in device-tool calls (see ../.library/device): build Octavo with its
# CUDA kernels on the GPU machine (no package registry there: --no-build-isolation, --no-deps),
# run the CUDA tests, then the benchmarks. Logs go to $OUT, which the device tool brings back.
#
#   bash bench/gpu_session.sh [tests|kernels|e2e|bench|all]     (default: all; bench = kernels + e2e)
#
# Each part fits one device-tool command (10 minutes): run them as separate calls, each within the
# machine's 30 s of warmth after the last, so that the build directory (pyproject.toml's
# build/wheel/..., ignored by git and so kept on a warm machine) makes the next build quick.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/octavo-gpu}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# sm_90 only: half the compile time of the default "80;90" on a Hopper machine.
# OCTAVO_ENABLE_CUDA=ON: a build that quietly left CUDA out would skip every test below.
python3 -m pip install -q --no-build-isolation --no-deps -C cmake.define.OCTAVO_CUDA_ARCHITECTURES=90 \
  -C cmake.define.OCTAVO_ENABLE_CUDA=ON . 2>&1 | tail -20 | tee "$OUT/build.log" || exit 1
python3 -c "import octavo, torch; print(octavo._C.cuda_compiled(), octavo._C.cuda_device_count(), torch.__version__)"
python3 -c "import octavo, sys; sys.exit(octavo._C.cuda_device_count() == 0)" || { echo "no GPU seen"; exit 1; }
if [[ $what == tests || $what == all ]]; then
  # The CUDA test files by name: collecting every file would import the server's packages,
  # which the GPU machine lacks.
  python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_ops.py tests/python/test_cuda_sampling.py \
    tests/python/test_cuda_elementwise_ops.py tests/python/test_cuda_attention.py tests/python/test_cuda_engine.py \
    tests/python/test_build_info.py 2>&1 | tail -40 | tee "$OUT/tests.log"
fi
if [[ $what == kernels || $what == bench || $what == all ]]; then
  python3 bench/python/bench_cuda.py 2>&1 | tee "$OUT/bench_cuda.log"
fi
if [[ $what == e2e || $what == bench || $what == all ]]; then
  python3 -m octavo.entrypoints.cli bench latency --device cuda --dummy-shape llama-3-8b --dtype bfloat16 2>&1 | tail -5 | tee "$OUT/latency.log"
  python3 -m octavo.entrypoints.cli bench latency --device cuda --dummy-shape llama-3-8b --dtype bfloat16 \
    --quantization int4 2>&1 | tail -5 | tee -a "$OUT/latency.log"
  python3 -m octavo.entrypoints.cli bench throughput --device cuda --dummy-shape llama-3-8b --input-len 512 --output-len 256 \
    --num-requests 256 --baseline-batch 32 64 2>&1 | grep -v "it/s]" | tail -8 | tee "$OUT/throughput.log"
  python3 bench/python/profile_step.py --batch 1 64 2>&1 | grep -v "^USDT\|^STAGE" | tee "$OUT/profile.log" | head -60
fi
