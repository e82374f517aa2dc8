# The README's two commands: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo bench test test-quick test-deps install install-systemd clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: on these machines it is a CPU build from local disk; then the
# project with the same pin as a constraint, so nothing pulls a CUDA build in.
# DS_BUILD_OPS=0: DeepSpeed builds no C++/CUDA ops at install (they are JIT-built if used).
# .[test] is every role (pyproject.toml: node, control, rendezvous, bench) and the test tools:
# make demo runs the daemon, the agents and the trainers on this machine.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	rm -rf spotvisor.egg-info  # a stale one in the root shadows the entry points (torchrun's backend) from here
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spotvisord demo --config configs/local.yaml --summary-json demo-summary.json

# spotvisor vs restart-on-preemption vs elastic-only: same job, same preemption trace
# (bench/README.md); prints the table and writes bench-results.json
bench: $(STAMP)
	$(PY) -m bench.compare

# Three pytest-xdist workers (CI has 2 cores; most tests wait on subprocesses): the `slow`
# tests (torchrun jobs, demo runs) form two lanes, each run one test at a time on its own
# worker, while the third worker takes the rest (tests/conftest.py). TEST_WORKERS=0 runs
# everything in this process, one test at a time.
TEST_WORKERS ?= 3
TEST_XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)

test: $(STAMP) test-deps
	$(PY) -m pytest -q --durations=25 $(TEST_XDIST)

# what the tests need from the system: Debian's prometheus (the dashboard test scrapes the
# daemon with a real one) and etcd-server (/usr/bin/etcd: tests/etcd_cluster.py starts a
# 3-member cluster on loopback for the HA tests); each test fails, never skips, without
# them. Needs root (or sudo).
test-deps:
	@{ command -v prometheus >/dev/null && test -x /usr/bin/etcd; } || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q prometheus etcd-server; }

test-quick: $(STAMP) test-deps
	$(PY) -m pytest -q -m 'not slow' $(TEST_XDIST)

clean:
	rm -rf .spotvisor .spotvisor-migrate demo-summary.json .pytest_cache

# `sudo make install-systemd`: the three units (systemd/*.service: what each runs and
# why its hardening is what it is) and the `spotvisor` system user (systemd/spotvisor.sysusers),
# then systemd-sysusers and daemon-reload. The commands must already be installed in
# BINDIR (`pip install '.[control,rendezvous]'` into the system, or into a venv outside /home and /root, which
# ProtectHome= hides: e.g. `python3 -m venv /opt/spotvisor && /opt/spotvisor/bin/pip install '.[control,rendezvous]'`
# then BINDIR=/opt/spotvisor/bin); the units' ExecStart= lines are rewritten to BINDIR.
# DESTDIR=DIR stages the files under DIR and touches nothing on the system (packaging; the
# test that runs systemd-analyze verify on what this target installs).
BINDIR ?= /usr/local/bin
UNITDIR ?= /etc/systemd/system
SYSUSERSDIR ?= /etc/sysusers.d
install-systemd:
	@test -x $(BINDIR)/spotvisord || { echo "install-systemd: no $(BINDIR)/spotvisord; pip install '.[control,rendezvous]' first, or set BINDIR=" >&2; exit 2; }
	@if [ -z "$(DESTDIR)" ]; then case "$$(realpath -m $(BINDIR))/" in /tmp/*|/var/tmp/*|/home/*|/root/*) \
		echo "install-systemd: BINDIR $(BINDIR) is under /tmp, /var/tmp, /home or /root, which the units hide (PrivateTmp=, ProtectHome=); install into a venv elsewhere, e.g. /opt/spotvisor" >&2; exit 2;; esac; fi
	install -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR)
	for unit in systemd/*.service; do \
		sed 's|/usr/local/bin/|$(BINDIR)/|g' $$unit > $(DESTDIR)$(UNITDIR)/$$(basename $$unit) && \
		chmod 0644 $(DESTDIR)$(UNITDIR)/$$(basename $$unit) || exit 1; \
	done
	install -m 0644 systemd/spotvisor.sysusers $(DESTDIR)$(SYSUSERSDIR)/spotvisor.conf
	if [ -z "$(DESTDIR)" ]; then systemd-sysusers $(SYSUSERSDIR)/spotvisor.conf && systemctl daemon-reload; fi
