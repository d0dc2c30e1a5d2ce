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

test: install
	$(BIN)/pytest -q

clean:
	rm -rf results .snakemake
