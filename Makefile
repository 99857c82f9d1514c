# Every target sets itself up: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: setup demo test compose bench lint reliability clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first so the `hf` extra's range is already satisfied.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[hf,sglang,demo,test]"
	# SGLang's own HTTP contract types for the sglang adapter's contract tests; only its
	# generated api_types (msgspec) and io_struct (read as data) are used, so no dependencies.
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/async_grpo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra -m "not docker"

# docker-compose.yml and the Dockerfile in real containers (a few minutes): needs a Docker
# engine with Compose v2, or ../shared/tools/docker-offline.sh to prepare one (see .ci/compose).
compose: $(STAMP)
	PY=$(PY) .ci/compose

bench: $(STAMP)
	$(PY) -m benchmarks

reliability: $(STAMP)
	$(PY) -m reliability

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
