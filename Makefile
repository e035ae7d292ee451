# Two commands do everything: `make serve` and `make test`. Both create .venv if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve sim test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/inference-lab serve

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

bench: $(STAMP)
	$(BIN)/python scripts/bench_sim.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
