# Two commands do all set-up: `make demo` and `make test`.
#
# PyTorch: TORCH_SPEC is installed before the project, so the project's own `torch>=2.4`
# requirement is already satisfied and pip never reaches for a multi-GB CUDA build on a
# CPU-only machine. On a GPU machine choose a CUDA build explicitly, e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cu126
# and on a CPU machine whose pip has no local CPU wheel:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# vpscluster provision's firewall and overlay roles, rehearsed on sandbox nodes.
PROVISION_PACKAGES := nftables wireguard-tools wireguard-go

# Debian packages the sandbox (emulated cluster) and its tests need (nats-server: `vpscluster queue up`).
SYSTEM_PACKAGES := openssh-server openssh-client iproute2 iperf3 rsync procps util-linux prometheus prometheus-node-exporter chromium nats-server

.PHONY: setup demo test system-deps venv-deps clean

$(VENV)/.installed: pyproject.toml
	@$(MAKE) --no-print-directory venv-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/vpscluster train

# `python3 -m venv` needs ensurepip, which Debian and Ubuntu ship apart (python3.X-venv): install
# it when root, or say in one line what to install.
venv-deps:
	@$(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 || { \
	  pkg=python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $$pkg (python3 -m venv needs it)"; \
	    apt-get update -qq && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg \
	      || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv; } >/dev/null; \
	  else echo "make: $(PYTHON) -m venv needs ensurepip: install it (sudo apt-get install $$pkg, or python3-venv) and run make again" >&2; exit 1; fi; \
	}

# Installs the Debian packages the integration tests use when running as root and any is
# missing; without root the sandbox tests skip and say why.
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES) $(PROVISION_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "not root: sandbox tests will skip (missing:$$missing)"; fi; \
	fi

test: setup system-deps
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
