# Set-up and everyday commands. `make serve` and `make test` each build the
# virtual environment on first use, so they are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test bench lint clean system-deps browser-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Exactly this torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

# CONFIG=path runs another Serve config (the README's test points it at a free port).
CONFIG ?= configs/config.yaml
serve: $(STAMP)
	$(VENV)/bin/serve run $(CONFIG)

test: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks

# Optional extras for the browser and terminal tests (they skip without them):
# Debian's chromium and tmux (needs root), and playwright-core from npm.
system-deps:
	command -v chromium >/dev/null && command -v tmux >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq chromium tmux >/dev/null)

browser-deps:
	npm ci --prefix tests/browser --no-audit --no-fund --silent

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
