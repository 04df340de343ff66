# Two commands do all setup on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test bench demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,report,test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/tidegate serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	# targets a running `tidegate serve --config examples/surge.yaml` (see README)
	$(BIN)/tidegate bench --scenario surge --ignore-eos --max-tokens const:32

clean:
	rm -rf $(VENV) build *.egg-info
