# Two entry points: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := prometheus prometheus-alertmanager redis-server postgresql

.PHONY: demo test venv venv-test debs lint bench dashboards alerts example-config clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The production package and the lab (simulator, bench, demo) beside it, both editable.
venv: $(BIN)/python
	$(BIN)/pip install -q -e . -e ./lab

venv-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' -e ./lab

# Debian packages the end-to-end tests use; installed only when missing.
debs:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

demo: venv
	$(BIN)/tollbooth demo

test: venv-test debs
	$(BIN)/ruff check sidecar lab tests benchmarks dashboards alerts
	$(BIN)/python -m pytest -q

lint: venv-test
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv
	$(BIN)/python benchmarks/overhead.py

dashboards: venv
	$(BIN)/pip install -q -e '.[dashboards]'
	$(BIN)/python -m dashboards.build

alerts: venv
	$(BIN)/python -m alerts.build

# tollbooth.example.yaml is generated from sidecar/config.py; tests/test_config.py checks it.
example-config: venv
	$(BIN)/tollbooth config --print-defaults > tollbooth.example.yaml

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
