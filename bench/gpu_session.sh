#!/usr/bin/env bash
# The GPU checks, in device-tool calls (see ../.library/device): build Octavo with its CUDA kernels
# on the GPU machine (no package registry there: --no-build-isolation, --no-deps), run the CUDA
# tests, then the benchmarks. Logs go to $OUT, which the device tool brings back.
#
#   bash bench/gpu_session.sh [PART[,PART...]] [--quick]
#   PART: tests, kernels (with moe), moe, e2e, bench (= kernels,e2e), candidates or all (the default)
#   candidates: end to end with the paths that wait for a measurement to become defaults
#   (layers/linear.py's CUDA_TENSOR_CORE_MAX_ROWS and CUDA_FP8_GEMM_FROM_ROWS), each beside
#   today's default in the same call. Not in `all`.
#
# The build uses the machine's own compiler ($CXX; on the lent machines a GCC build that links
# libstdc++ statically into the module); OCTAVO_CXX=g++ builds with the distribution's instead.
# Each part fits one device-tool command (10 minutes); `all --quick` fits one with room to spare.
# Run separate parts within the machine's 30 s of warmth after the last, so that the build
# directory (pyproject.toml's build/wheel/..., ignored by git and kept on a warm machine) makes
# the next build quick. The machine lacks pyzmq and msgspec, which the engine core's process and
# the worker processes need: carry them as wheels in .whl (../.library/device/README.md says how)
# and they are installed first.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/octavo-gpu}
mkdir -p "$OUT"
what=${1:-all}
quick=${2:-}
part() { [[ ($what == all && $1 != candidates) || ,$what, == *,$1,* || ($1 == moe && ,$what, == *,kernels,*) ||
            ($what == bench && ($1 == kernels || $1 == moe || $1 == e2e)) ]]; }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -n ${OCTAVO_CXX:-} ]]; then export CXX=$OCTAVO_CXX CUDAHOSTCXX=$OCTAVO_CXX; fi
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  echo "CXX=${CXX:-unset}: $(${CXX:-c++} --version | head -1)"
  grep -m1 "model name" /proc/cpuinfo
} | tee "$OUT/device.txt"
# sm_90 only: half the compile time of the default "80;90" on a Hopper machine.
# OCTAVO_ENABLE_CUDA=ON: a build that quietly left CUDA out would skip every test below.
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -C cmake.define.OCTAVO_CUDA_ARCHITECTURES=90 \
  -C cmake.define.OCTAVO_ENABLE_CUDA=ON . 2>&1 | tail -20 | tee "$OUT/build.log" || exit 1
module=$(python3 -c "import octavo, pathlib; print(next(pathlib.Path(octavo.__file__).parent.glob('_C*.so')))")
echo "built in $(($(date +%s) - start)) s; $module links: $(ldd "$module" | grep -o 'libstdc++[^ ]*' || echo 'no shared libstdc++')" \
  | tee -a "$OUT/build.log"
python3 -c "import octavo, torch; print(octavo._C.cuda_compiled(), octavo._C.cuda_device_count(), torch.__version__)"
python3 -c "import octavo, sys; sys.exit(octavo._C.cuda_device_count() == 0)" || { echo "no GPU seen"; exit 1; }
if part tests; then
  # The module as built here, after `import torch`: whole error messages, ops on both devices
  # (the ldd check inside applies to a static libstdc++ build only).
  if ! ldd "$module" | grep -q libstdc++; then
    python3 tests/static_libstdcxx/check_module.py "$module" 2>&1 | tee "$OUT/static_libstdcxx.log"
  fi
  # The CUDA test files by name: collecting every file would import the server's packages,
  # which the GPU machine lacks.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_ops.py tests/python/test_cuda_sampling.py \
    tests/python/test_cuda_elementwise_ops.py tests/python/test_cuda_attention.py tests/python/test_cuda_engine.py \
    tests/python/test_cuda_moe_ops.py tests/python/test_moe_models.py::test_greedy_tokens_match_transformers_on_the_gpu \
    tests/python/test_cuda_processes.py tests/python/test_build_info.py 2>&1 | tee "$OUT/tests_full.log" | tail -40 \
    | tee "$OUT/tests.log"
fi
cli="python3 -m octavo.entrypoints.cli"
if part e2e; then
  # In this process, then with the engine core in its own process (as `octavo serve` runs it).
  for layout in "" --multiprocess; do
    timeout 150 $cli bench latency --device cuda --dummy-shape llama-3-8b --dtype bfloat16 $layout 2>&1 \
      | grep -v "it/s]" | tail -5 | tee -a "$OUT/latency.log"
  done
fi
if part e2e && [[ -z $quick ]]; then
  # The same with cuBLAS for every dense product (the engine before it took Octavo's GEMV).
  timeout 150 python3 -c "import octavo.layers.linear as l; l.CUDA_DENSE_KERNEL_MAX_ROWS.clear()
from octavo.entrypoints.cli import main
main('bench latency --device cuda --dummy-shape llama-3-8b --dtype bfloat16'.split())" 2>&1 \
    | grep -v "it/s]" | tail -4 | sed 's/^/cuBLAS dense: /' | tee -a "$OUT/latency.log"
fi
if part kernels; then
  timeout 240 python3 bench/python/bench_cuda.py $quick 2>&1 | tee "$OUT/bench_cuda.log"
fi
if part moe; then
  # fused_moe against the torch loop over experts (decode and prefill sizes), moe_align alone.
  timeout 200 python3 bench/python/bench_moe.py --device cuda --shapes qwen3 mixtral --formats dense int4 \
    --tokens 1 16 64 512 2048 --repeats 5 --align-tokens 4096 16384 2>&1 | tee "$OUT/bench_moe.log"
  # The same calls replayed from CUDA graphs (as decode steps run them), kernel by kernel.
  (cd bench/python && timeout 120 python3 probe_moe_cuda.py --tokens 1 4 16 64 2048 2>&1 | grep -v -i warn \
    | tee "$OUT/probe_moe.log")
fi
if part moe && [[ -z $quick ]]; then
  # Both CUDA paths of fused_moe at the same sizes: where the tensor cores start to win.
  for from in 0 1073741824; do
    OCTAVO_FUSED_MOE_MMA_FROM_PAIRS=$from timeout 150 python3 bench/python/bench_moe.py --device cuda \
      --shapes qwen3 mixtral --formats dense int4 --tokens 1 2 4 8 16 32 64 128 --repeats 5 2>&1 \
      | sed "s/^/mma from $from: /" | tee -a "$OUT/moe_paths.log"
  done
fi
if part e2e; then
  baseline=$([[ -z $quick ]] && echo "32 64")
  timeout 240 $cli bench throughput --device cuda --dummy-shape llama-3-8b --input-len 512 --output-len 256 \
    --num-requests 256 --baseline-batch $baseline 2>&1 | grep -v "it/s]" | tail -8 | tee "$OUT/throughput.log"
  timeout 150 $cli bench throughput --device cuda --dummy-shape llama-3-8b --input-len 512 --output-len 256 \
    --num-requests 256 --baseline-batch --multiprocess 2>&1 | grep -v "it/s]" | tail -2 | tee -a "$OUT/throughput.log"
  if [[ -z $quick ]]; then
    timeout 300 $cli bench latency --device cuda --dummy-shape llama-3-8b --dtype bfloat16 --quantization int4 2>&1 \
      | tail -5 | tee -a "$OUT/latency.log"
    python3 bench/python/profile_step.py --batch 1 64 2>&1 | grep -v "^USDT\|^STAGE" | tee "$OUT/profile.log" | head -60
  fi
fi
if part candidates; then
  # `bench latency` / `throughput` in this process with one module constant set ("" = today's
  # default): int4 decode with linear on tensor cores up to 16 / 64 rows, fp8 weights W8A8 from
  # 256 rows (prefill chunks) against weight-only.
  candidate() {  # NAME VALUE ARGS...
    local name=$1 value=$2; shift 2
    timeout 200 python3 -c "import sys, octavo.layers.linear as l
if '$value': setattr(l, '$name', float('$value') if '$value' == 'inf' else int('$value'))
from octavo.entrypoints.cli import main
main(sys.argv[1:])" "$@" 2>&1 | grep -v "it/s]" | tail -3 | sed "s/^/$name=${value:-default} $2: /" \
      | tee -a "$OUT/candidates.log"
  }
  shape="--device cuda --dummy-shape llama-3-8b"
  for rows in "" 16; do candidate CUDA_TENSOR_CORE_MAX_ROWS "$rows" bench latency $shape --dtype bfloat16 \
    --quantization int4; done
  requests="--dtype bfloat16 --input-len 512 --output-len 128 --num-requests 64 --baseline-batch"
  for rows in "" 64; do candidate CUDA_TENSOR_CORE_MAX_ROWS "$rows" bench throughput $shape --quantization int4 \
    $requests; done
  for rows in "" 256; do candidate CUDA_FP8_GEMM_FROM_ROWS "$rows" bench throughput $shape --quantization fp8 \
    $requests; done
fi
