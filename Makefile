# Two commands: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs serve-docs bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned and installed first: that wheel is local; an unpinned torch would
# pull a multi-GB CUDA build. The package itself only asks for torch>=2.4.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/leantrain train --preset digits-mlp --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

# The documentation site (mkdocs, in the test extra): built into site/, or served locally.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

serve-docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

bench: $(STAMP)
	$(BIN)/python benchmarks/optimizer_step.py
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) runs site build *.egg-info src/*.egg-info
