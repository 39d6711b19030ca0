# The two commands of the README: `make demo` and `make test`. Both install everything first.
SHELL := /bin/bash
PYTHON ?= /usr/bin/python3
VENV := .venv
BIN := $(VENV)/bin
RPC_PROTO ?= /usr/local/share/criu/rpc.proto
PROTO_OUT := stasis/engine/_proto
# A plain path in a .pth: setuptools' default editable finder costs every `stasis` command
# ~20 ms of imports (importlib.util, pathlib) before it does anything.
EDITABLE := --config-settings editable_mode=compat -e

.PHONY: install system venv proto bytecode init test test-serial demo bench lint format clean image docs deb deb-inputs

install: system venv proto bytecode init

# CRIU >= 4.2 (built from Debian's source with our patches), tini, iptables, build tools;
# Slurm; the test applications; containerd and runc.
system:
	bash scripts/install-criu.sh
	bash scripts/install-slurm.sh
	bash scripts/install-test-apps.sh
	bash scripts/install-containers.sh

venv: $(BIN)/stasis

$(BIN)/stasis: pyproject.toml
	test -x $(PYTHON) || apt-get install -y -q python3 python3-venv
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==24.3.1
	$(BIN)/pip install -q $(EDITABLE) '.[dev]'
	touch $@

# The init of every job's PID namespace (static: it is part of every checkpoint, keep it small).
# Jobs exec it as their own user: it goes where every user may run it, not only into the venv.
# The node package puts the same binary at the same path: CRIU restores it by path (and checks
# its size and build-id), so a checkpoint of either install restores on the other.
INIT := /usr/libexec/stasis/stasis-init
# Where `make install` put it before: checkpoints made then name this path.
OLD_INIT := /usr/local/libexec/stasis/stasis-init
init: $(INIT)
	mkdir -p $(dir $(OLD_INIT)) && ln -sfn $(INIT) $(OLD_INIT)

$(BIN)/stasis-init: stasis/daemon/stasis-init.c $(BIN)/stasis
	gcc -O2 -Wall -Wextra -Werror -static -o $@ $<

# Running jobs run it: a changed one never replaces it in place (a job whose init was deleted
# under it could no longer be restored by its owner): the old one is moved aside under its hash
# (its jobs then show that path, and their checkpoints find it); the old path's is moved here.
$(INIT): $(BIN)/stasis-init
	mkdir -p $(dir $@)
	if [ ! -e $@ ] && [ -f $(OLD_INIT) ] && [ ! -L $(OLD_INIT) ]; then mv $(OLD_INIT) $@; fi
	if ! cmp -s $< $@; then \
	    if [ -f $@ ]; then mv -f $@ $@.$$(sha256sum < $@ | cut -c1-16); fi; \
	    install -m 0755 $< $@.new && mv -f $@.new $@; \
	fi

# CRIU's RPC classes come from the rpc.proto of the CRIU that is installed, never from a copy.
proto: $(PROTO_OUT)/rpc_pb2.py

$(PROTO_OUT)/rpc_pb2.py: $(RPC_PROTO)
	mkdir -p $(PROTO_OUT)
	protoc --python_out=$(PROTO_OUT) -I $(dir $(RPC_PROTO)) $(RPC_PROTO)
	touch $(PROTO_OUT)/__init__.py

# Written here because imports may not write it (PYTHONDONTWRITEBYTECODE is set on some machines):
# every CLI call and job supervisor would otherwise compile stasis again (~30 ms each).
bytecode: venv proto
	$(BIN)/python -m compileall -q stasis

# What the node packages are built from besides this checkout: our CRIU (built here) and the
# RPC classes of its rpc.proto. Not the test bench.
deb-inputs:
	bash scripts/install-criu.sh
	$(MAKE) proto

# The node packages, without the test bench: build/stasis_VERSION_ARCH.deb and
# build/stasis-criu_CRIU_ARCH.deb (scripts/build-deb.sh).
deb: deb-inputs
	bash scripts/build-deb.sh

# The node agent's container image, an OCI archive: build/stasis-agent-VERSION.oci.tar
# (scripts/build-image.sh: the node packages, which it builds, in a Debian root).
image: deb-inputs
	bash scripts/build-image.sh

lint: install
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

format: venv
	$(BIN)/ruff format --quiet .
	$(BIN)/ruff check --fix --quiet .

# Two workers: the tests mostly wait (tests/parallel.py says what may run beside what).
test: lint
	$(BIN)/pytest -q -n 2 --dist loadgroup --durations=40 tests

# One process, the tests in file order: to tell a test's own failure from a neighbour's.
test-serial: lint
	$(BIN)/pytest -q -p no:xdist --durations=40 tests

demo: install
	$(BIN)/python -m stasis.dev demo

# The commit whose dump and restore times bench.run holds this tree to, case by case in the same
# run (within 5%): the last one before images were hashed with BLAKE3 (issue 27). Empty: none.
BENCH_BASELINE ?= 740b3ca

bench: install
	$(BIN)/pip install -q $(EDITABLE) '.[dev,bench]'
	$(BIN)/python -m bench.run $(if $(BENCH_BASELINE),--baseline-ref $(BENCH_BASELINE)) $(BENCH_ARGS)
	$(BIN)/python -m bench.labels $(BENCH_LABELS_ARGS)
	$(BIN)/python -m bench.containers $(BENCH_CONTAINERS_ARGS)
	$(BIN)/python -m bench.slurm_nodes $(BENCH_NODES_ARGS)
	$(BIN)/python -m bench.soak $(BENCH_SOAK_ARGS)
	$(BIN)/python -m bench.verify $(BENCH_VERIFY_ARGS)
	$(BIN)/python -m bench.freeze $(BENCH_FREEZE_ARGS)
	$(BIN)/python -m bench.multinode $(BENCH_MULTINODE_ARGS)

# docs/cli.md, generated from the CLI's parsers, and docs/configuration.md from the settings'
# declarations (tests/test_docs.py fails when either is stale); the chart's README from its
# values.yaml (tests/k8s/test_chart.py).
docs: venv
	$(BIN)/python -m stasis.cli.reference > docs/cli.md.new && mv docs/cli.md.new docs/cli.md
	$(BIN)/python -m stasis.configdoc > docs/configuration.md.new && \
	    mv docs/configuration.md.new docs/configuration.md
	$(BIN)/python -m stasis.k8s.chartdoc > charts/stasis/README.md.new && \
	    mv charts/stasis/README.md.new charts/stasis/README.md

clean:
	rm -rf $(VENV) $(PROTO_OUT)
