# Every target sets itself up: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# torch's CPU build, as in the Dockerfile: an ordinary index's torch for Linux is the CUDA build
# (several GB of CUDA libraries). Wheels in a find-links directory of pip's own configuration
# count too, so a machine that cannot reach this index installs the CPU wheel from there.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# vLLM (its CPU build) lives in its own cached environment: the vllm engine's tests start servers
# from it, rollfleet talks HTTP to them (.ci/vllm-env; without network the tests skip and say why).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP  = $(VLLM_VENV)/.installed

.PHONY: setup envs demo test test-long test-vllm vllm-env compose bench lint reliability adversary clean

setup: $(STAMP)

# Both environments at once: each is mostly downloads and unpacking on one core, so a fresh
# machine's `make test` waits for the longer of the two (about 110 s here), not their sum (208 s).
envs:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first so the `hf` extra's range is already satisfied; torch alone from
	# that index (its dependencies, plain Python packages, come with the next line).
	# (--retries 1: an index that cannot be reached costs a second, not pip's 5 tries with backoff.)
	$(PY) -m pip install -q --retries 1 --no-deps --index-url "$(TORCH_INDEX_URL)" "torch==2.13.0"
	$(PY) -m pip install -q -e ".[hf,sglang,demo,test,objects,gateway]"
	# SGLang's own HTTP contract types for the sglang adapter's contract tests; only its
	# generated api_types (msgspec) and io_struct (read as data) are used, so no dependencies.
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/async_grpo.py

# Test files run on TEST_WORKERS parallel workers (most tests wait on brokers, processes and
# timers, not on a core: the suite used 1.14 of 2 cores on 3 workers); a file stays on one
# worker, so its module-wide fixtures start once. The longest files start first (tests/conftest.py
# orders them by tests/file_seconds.json; xdist's own reorder, by number of tests, would start a
# one-test file of a minute last). The tests against a real vLLM server run after them, alone:
# while it generates, vLLM's CPU build spins on every core, and tests beside it that wait on
# timers time out (two runs with it among the others failed 3 tests each).
TEST_WORKERS ?= 4
test: envs
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not docker and not heavy and not long and not vllm"
	ROLLFLEET_VLLM_VENV=$(VLLM_VENV) $(PY) -m pytest -q -ra --durations=10 -m "vllm and not heavy and not docker"

# The long scenarios that `make test` keeps one short representative of (minutes).
test-long: envs
	ROLLFLEET_VLLM_VENV=$(VLLM_VENV) $(PY) -m pytest -q -ra --durations=30 -m "long and not docker and not heavy"

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): .ci/vllm-env
	PYTHON=$(PYTHON) .ci/vllm-env $(VLLM_VENV)

# Only the tests against a real vLLM server (a few minutes on 2 cores).
test-vllm: envs
	ROLLFLEET_VLLM_VENV=$(VLLM_VENV) $(PY) -m pytest -q -ra -m vllm

# docker-compose.yml and the Dockerfile in real containers (a few minutes): needs a Docker
# engine with Compose v2, or ../shared/tools/docker-offline.sh to prepare one (see .ci/compose).
compose: $(STAMP)
	PY=$(PY) .ci/compose

bench: $(STAMP)
	$(PY) -m benchmarks

# The full reliability suite; its adversary campaign (scenario 12) adds FRESH fresh seeds to its
# fixed ones, printed so that each run can be replayed.
FRESH ?= 2
reliability: $(STAMP)
	RF_ADV_FRESH_SEEDS=$(FRESH) $(PY) -m reliability

# The machine adversary alone: SEEDS fresh random seeds of DURATION seconds, printed first, each replayable.
SEEDS ?= 3
DURATION ?= 60
adversary: $(STAMP)
	$(PY) -m reliability.adversary --campaign $(SEEDS) --duration $(DURATION)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log .pytest_cache build *.egg-info
