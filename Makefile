# Everything bootstraps itself: a fresh machine needs only python3 (>= 3.11) and a C compiler.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
EXT_SRC := $(wildcard cext/*.pyx cext/*.pxd) setup.py
# The extensions are compiled in parallel (the C of _tick and _eta at -O3 takes minutes).
BUILD_JOBS := -j 2

.PHONY: run simulate test test-debug build lint bench clean

# The devbox (docs/devbox.md): a supervisor, its shard and a local worker on a temporary
# directory, running the bundled example workload; prints a summary and stops everything.
run: $(EXT)
	$(VENV)/bin/leasehold devbox

# The trace simulator (docs/simulator.md): scheduling policies compared on the bundled trace.
simulate: $(EXT)
	$(VENV)/bin/leasehold simulate engine/examples/trace.jsonl

# Two pytest workers (-n 2): most of the suite's wall time is real processes starting and
# waiting on each other, which a second worker overlaps even on two cores. Each run has a
# temporary directory of its own: pytest's default is shared by every run of one user and keeps
# only the newest three, so a second run on the machine would delete a running one's sockets
# and lock files. Removed after a passing run; a failing run's is kept and named.
define run_pytest
base=$$(mktemp -d "$${TMPDIR:-/tmp}/leasehold-pytest.XXXXXX") || exit 1; \
$(1) $(PY) -m pytest -n 2 --basetemp="$$base"; status=$$?; \
if [ $$status -eq 0 ]; then rm -rf "$$base"; \
else echo "make: the failed run's temporary files are in $$base" >&2; fi
endef

test: $(EXT)
	@$(call run_pytest,); exit $$status

# The same suite against the debug build: bounds and initialisation checks on (wraparound
# stays off), so a bad or -1 index raises and fails the test it happens in. LEASEHOLD_DEBUG
# for pytest makes it refuse a release build. The release stamp goes first, so an interrupted
# run cannot leave the debug build in place for `make test`; it is rebuilt afterwards
# (unless KEEP_DEBUG_BUILD=1: CI, whose clone is thrown away, saves the minute). (The release
# build is made here, not by $(MAKE) build: make runs a line naming $(MAKE) even under -n.)
test-debug: $(DEPS)
	rm -f $(EXT)
	LEASEHOLD_DEBUG=1 $(PY) setup.py -q build_ext --inplace $(BUILD_JOBS)
	@$(call run_pytest,LEASEHOLD_DEBUG=1); \
	if [ "$(KEEP_DEBUG_BUILD)" != 1 ]; then \
		$(PY) setup.py -q build_ext --inplace $(BUILD_JOBS) && touch $(EXT) || exit 1; fi; \
	exit $$status

build: $(EXT)

lint: $(DEPS)
	$(VENV)/bin/ruff check engine cext transport storage tests bench setup.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH cython-lint cext

bench: $(EXT)
	$(PY) bench/tick.py
	$(PY) bench/heartbeat.py

$(PY):
	$(PYTHON) -m venv $(VENV)

# --no-compile: pip would byte-compile every installed module (flyte, kubernetes, grpc, ...),
# about a minute here; Python compiles what is imported, once, when it is first imported.
$(DEPS): setup.py pyproject.toml | $(PY)
	$(PY) -m pip install -q --no-compile --upgrade pip setuptools wheel cython numpy
	LEASEHOLD_NO_EXT=1 $(PY) -m pip install -q --no-compile --no-build-isolation -e '.[test,flyte]'
	touch $@

$(EXT): $(DEPS) $(EXT_SRC)
	$(PY) setup.py -q build_ext --inplace $(BUILD_JOBS)
	touch $@

clean:
	rm -rf build $(VENV) *.egg-info cext/*.c cext/*.so cext/*.html
