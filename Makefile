# Two entry points: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := prometheus prometheus-alertmanager redis-server postgresql chromium

.PHONY: demo test venv venv-test debs lint bench bench-pinned dashboards alerts example-config clean

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

# The overhead with the proxy alone on CPU 0, wrk and the upstream on CPU 1 (Debian package wrk,
# installed when missing). Before and after a change, in one run:
#   make bench-pinned ARGS="--rev e714d0c --tree after=."
bench-pinned: venv
	@command -v wrk >/dev/null 2>&1 || { \
	  echo "installing the Debian package wrk (the load generator)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends wrk >/dev/null; \
	}
	$(BIN)/python benchmarks/pinned.py $(ARGS)

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
