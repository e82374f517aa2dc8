# The README's two commands: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick install install-systemd clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: on these machines it is a CPU build from local disk; then the
# project with the same pin as a constraint, so nothing pulls a CUDA build in.
# DS_BUILD_OPS=0: DeepSpeed builds no C++/CUDA ops at install (they are JIT-built if used).
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spotvisord demo --config configs/local.yaml --summary-json demo-summary.json

test: $(STAMP)
	$(PY) -m pytest -q

test-quick: $(STAMP)
	$(PY) -m pytest -q -m 'not slow'

clean:
	rm -rf .spotvisor demo-summary.json .pytest_cache

# Installs the three units (needs root); see systemd/*.service for what each runs.
install-systemd:
	install -m 0644 systemd/spotvisord.service systemd/spotvisor-rendezvous.service systemd/spotvisor-agent.service /etc/systemd/system/
	systemctl daemon-reload
