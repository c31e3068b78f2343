# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV := .venv
BELAYER := $(VENV)/bin/belayer
PYTEST := $(VENV)/bin/pytest
PYTEST_ARGS ?=
# Two workers (pytest-xdist) halve the suite on this 2-core machine: much of a test's time is
# one process waiting on another (a server starting, a container restoring), so a second
# worker fills the idle core. Work units and their order: tests/parallel.py.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: help install test test-fast demo up down status clean-state

help:
	@echo "make demo    install what is missing, start the local stack, run the main job"
	@echo "make test    install what is missing, run the whole test suite"
	@echo "make test-fast   the pure and stack tiers only (no vLLM, no podman): the edit loop"
	@echo "make install install everything (idempotent; cached under ~/.cache/belayer)"
	@echo "make up | down | status   the local stack"

install:
	bash infra/install/all.sh

test: install
	$(PYTEST) $(PARALLEL) $(PYTEST_ARGS)

# Tiers are assigned from the fixtures a test uses (tests/tiers.py); a test with any of the
# engine, sandbox or whole markers needs vLLM, podman + CRIU or the whole stack.
test-fast: install
	$(PYTEST) $(PARALLEL) -m "not engine and not sandbox and not whole" $(PYTEST_ARGS)

demo: install
	bash infra/demo.sh

up: install
	$(BELAYER) up

down:
	$(BELAYER) down

status:
	$(BELAYER) status
