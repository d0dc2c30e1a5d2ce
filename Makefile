# Quick start: `make demo` (install + whole pipeline on CPU), `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: install demo test clean

$(BIN)/dflash: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[cpu,dev]'
	@touch $@

install: $(BIN)/dflash

demo: install
	$(BIN)/snakemake --cores $(CORES)

# The reference DFlash implementation (PyPI dflash 0.1.0, whose import name clashes with ours):
# unpacked, not installed; the compatibility tests load its model.py by path.
REFERENCE := .cache/dflash-reference
$(REFERENCE)/dflash/model.py:
	$(BIN)/pip download -q --no-deps dflash==0.1.0 -d $(REFERENCE)
	cd $(REFERENCE) && ../../$(BIN)/python -m zipfile -e dflash-0.1.0-py3-none-any.whl .
	@touch $@

test: install $(REFERENCE)/dflash/model.py
	DFLASH_REFERENCE_MODEL_PY=$(REFERENCE)/dflash/model.py $(BIN)/pytest -q

clean:
	rm -rf results .snakemake .cache
