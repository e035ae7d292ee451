# Two commands do everything: `make serve` and `make test`. Both create .venv if needed.
# `make serve PORT=9000 ARGS='--max-num-seqs 16'` passes a port and any other serve flags;
# `make test-fast` is the quick lane (no browser, Ray or subprocess-heavy tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8080
ARGS ?=

.PHONY: install serve sim test test-fast lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/inference-lab serve --port $(PORT) $(ARGS)

sim: $(STAMP)
	$(BIN)/inference-lab sim --config configs/gpt-oss-20b.toml --hardware b200 \
		--workload configs/workloads/quick.toml

lint: $(STAMP)
	$(BIN)/ruff check inference_lab tests scripts
	$(BIN)/ruff format --check inference_lab tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy inference_lab

pytest: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck pytest

# The quick lane: lint and every test not marked slow (tests/conftest.py says which are).
test-fast: lint $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python scripts/bench_sim.py

# The clients lane (not part of `make test`): litellm, aiperf, openai-agents and pydantic-ai,
# real clients of `serve`, in their own .venv-clients (`.[test,clients]`; about 3 minutes to
# install, 2 GB), so the main .venv keeps the versions the suite pins. Only 127.0.0.1; no network needed once
# installed.
.PHONY: test-clients
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed

$(CLIENTS_STAMP): pyproject.toml
	test -d $(CLIENTS_VENV) || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet -e '.[test,clients]'
	touch $(CLIENTS_STAMP)

test-clients: $(CLIENTS_STAMP)
	$(CLIENTS_VENV)/bin/python -m pytest -p no:dash tests/test_litellm_client.py tests/test_aiperf_client.py \
		tests/test_openai_agents_client.py tests/test_pydantic_ai_client.py

# The stress suite (not part of `make test`; about 2 minutes): fuzz, burst 1,000,
# disconnect storm, slow clients, soak, SIGTERM under load. SOAK_SECONDS=1200 for the
# 20-minute soak. Only 127.0.0.1.
.PHONY: stress
SOAK_SECONDS ?= 30
stress: $(STAMP)
	$(BIN)/python scripts/stress/run_all.py --soak-seconds $(SOAK_SECONDS)

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .mypy_cache .pytest_cache .ruff_cache
