# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
#
# torch is installed before anything else, pinned, so that pip takes the CPU wheel a machine
# offers (here: /opt/wheels via pip's find-links) instead of resolving an unpinned `torch`
# to the newest CUDA build (several GB). Elsewhere, override TORCH_SPEC / TORCH_INDEX, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: demo test install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/seqshard demo --out demo-out

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) demo-out .pytest_cache
