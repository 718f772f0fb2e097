# Set-up and everyday commands. `make serve` and `make test` each build the
# virtual environment on first use, so they are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench lint clean system-deps browser-deps interop-env interop k25-env

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

# The HTTP API, hand-off and bad-input suites run a second time behind Serve's HAProxy
# ingress (README, "High-throughput ingress"): the variable is read when Serve starts.
# A replica behind HAProxy stays reachable for Serve's drain period (30 s by default) when
# it stops, so load balancers can take it out first; every module's apps are deleted
# when it ends, and here nothing stands in front to deregister from, so 1 s.
HAPROXY_DRAIN ?= RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=1
HAPROXY_TESTS ?= tests/serve/test_api.py tests/serve/test_handoff.py tests/serve/test_bad_inputs.py \
	tests/serve/test_engine_gate.py

# The first pass runs its modules on TEST_WORKERS worker processes (pytest-xdist, one
# module per worker at a time, each worker with its Ray cluster): a serve test mostly waits
# (Serve's control loops, scaling windows), so two share the 2 cores well. The modules
# marked `alone` (tests/conftest.py: the chaos tests, the device script's CPU rehearsal)
# measure under a load they make themselves and run next, in one process with the machine
# to themselves. The HAProxy pass stays in one process too: Ray's HAProxy binds fixed ports.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

# transformers' Kimi_K25ImageProcessor (the K2.5 pixel parity, marked `torchvision`) needs
# torchvision, and none loads beside the CPU build of torch above: those cases run in an
# environment of their own: torch and torchvision pinned as a matching pair, resolved in
# one install with the project and its test extra (the pin is within the project's range).
K25_VENV := .venv-k25
K25_STAMP := $(K25_VENV)/.installed
K25_TORCH := torch==2.14.1 torchvision==0.29.1

$(K25_STAMP): pyproject.toml
	rm -rf $(K25_VENV)
	$(PYTHON) -m venv $(K25_VENV)
	$(K25_VENV)/bin/pip install --quiet $(K25_TORCH) -e '.[test]'
	touch $@

k25-env: $(K25_STAMP)

# The K2.5 environment (minutes from an empty pip cache, mostly downloading and unpacking)
# builds in the background while the first pass runs, its output in $(K25_LOG), shown if it
# fails; a pass that fails stops that build (its own process group) too. It runs at the
# lowest CPU priority: at normal priority, unpacking and compiling it on a warm pip cache
# beside the first pass and a busy core starved two Ray clusters' start-up past Ray's 30 s.
# The build is named through a variable so that `make -n test` prints it instead of
# running it.
K25_LOG := $(K25_VENV).log
K25_BUILD = nice -n 19 $(MAKE) --no-print-directory k25-env

test: $(STAMP)
	@setsid $(K25_BUILD) > $(K25_LOG) 2>&1 & k25=$$!; \
	trap 'kill -- -$$k25 2>/dev/null' EXIT; set -ex; \
	RAY_AUTH_MODE=disabled $(PY) -m pytest $(XDIST) -m "not alone and not torchvision" $(PYTEST_ARGS); \
	RAY_AUTH_MODE=disabled $(PY) -m pytest -m alone $(PYTEST_ARGS); \
	RAY_AUTH_MODE=disabled RAY_SERVE_ENABLE_HA_PROXY=1 $(HAPROXY_DRAIN) $(PY) -m pytest $(PYTEST_ARGS) $(HAPROXY_TESTS); \
	wait $$k25 || { cat $(K25_LOG); exit 1; }; trap - EXIT; \
	$(K25_VENV)/bin/python -m pytest -m torchvision $(PYTEST_ARGS) tests/kimi_encoder/test_parity_k25.py

# The inner loop: every test that starts no Ray cluster and runs no device script end to
# end (library, admission, fan-out, wire formats, docstring examples); `make test` stays
# the full suite that CI runs.
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not serve and not chaos and not script and not torchvision" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks

# Optional extras for the browser, terminal and Prometheus tests (they skip without
# them): Debian's chromium, tmux and prometheus (needs root), and playwright-core from
# npm. The test runs /usr/bin/prometheus itself on a free port; where systemd runs, the
# package also starts a service of its own on :9090 (Docker images deny that start).
system-deps:
	command -v chromium >/dev/null && command -v tmux >/dev/null && test -x /usr/bin/prometheus || \
	  (apt-get update -qq && apt-get install -y -qq chromium tmux >/dev/null && \
	   apt-get install -y -qq --no-install-recommends prometheus >/dev/null)

browser-deps:
	npm ci --prefix tests/browser --no-audit --no-fund --silent

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache

# sglang's and vLLM's own code, each in its own environment, checking what
# kimi_encoder/engines writes and what the served application (`serve run`, started
# by the tests) pushes and writes (tests/interop). Our side runs under $(PY).
SGLANG_VENV := .venv-sglang
VLLM_VENV := .venv-vllm

$(SGLANG_VENV)/.installed: tests/interop/requirements-sglang.txt
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -r tests/interop/requirements-sglang.txt
	touch $@

$(VLLM_VENV)/.installed: tests/interop/requirements-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r tests/interop/requirements-vllm.txt
	touch $@

interop-env: $(SGLANG_VENV)/.installed $(VLLM_VENV)/.installed

interop: interop-env $(STAMP)
	KIMI_ENCODER_PYTHON=$(abspath $(PY)) $(SGLANG_VENV)/bin/python -m pytest \
	  -c tests/interop/pytest.ini tests/interop/test_sglang.py tests/interop/test_sglang_service.py \
	  $(PYTEST_ARGS)
	KIMI_ENCODER_PYTHON=$(abspath $(PY)) VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest \
	  -c tests/interop/pytest.ini tests/interop/test_vllm.py tests/interop/test_vllm_push.py \
	  tests/interop/test_engine_routes.py $(PYTEST_ARGS)
