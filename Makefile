# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV := .venv
BELAYER := $(VENV)/bin/belayer
PYTEST := $(VENV)/bin/pytest
PYTEST_ARGS ?=

.PHONY: help install test demo up down status clean-state

help:
	@echo "make demo    install what is missing, start the local stack, run the main job"
	@echo "make test    install what is missing, run the whole test suite"
	@echo "make install install everything (idempotent; cached under ~/.cache/belayer)"
	@echo "make up | down | status   the local stack"

install:
	bash infra/install/all.sh

test: install
	$(PYTEST) $(PYTEST_ARGS)

demo: install
	bash infra/demo.sh

up: install
	$(BELAYER) up

down:
	$(BELAYER) down

status:
	$(BELAYER) status
