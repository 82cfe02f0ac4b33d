# The two commands of the README:
#   make demo   trains the digits example with ACP-SGD on 2 ranks (horovodrun --gloo)
#   make test   runs the whole test suite
# Both install what they need first (.venv, torch, Horovod from PyPI, hvd_acp).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvd_acp-installed
NP ?= 2

.PHONY: install demo test bench-smoke clean

install: $(STAMP)

$(STAMP): setup.py scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) examples/train.py --optimizer acp

test: install
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info

# S-SGD vs Power-SGD vs ACP-SGD on the examples (2 ranks, 3 seeds on digits,
# 1 on the language model); writes bench-results/compare/ (results.md and its pictures).
.PHONY: compare
compare: install
	$(PY) scripts/compare.py --np $(NP)

# The robustness grid (about an hour): digits CNN, every method over 2/4/8
# ranks, batch 32/128 per rank, momentum 0 / 0.9 / Nesterov, 3 seeds.
.PHONY: grid
grid: install
	$(PY) scripts/compare.py --tasks grid

# Every generated block of README.md and docs/, and the results.md pages
# beside the studies' runs, from bench-results/ (scripts/docgen.py); docs-check
# fails where a page is not what it would write (tests/test_docs.py runs it too).
.PHONY: docs docs-check
docs: install
	$(PY) scripts/docgen.py

docs-check: install
	$(PY) scripts/docgen.py --check

# A few steps of every method on a small model, 2 ranks, localhost (no emulation), 2 rounds.
bench-smoke: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks --model small --np $(NP) --steps 4 --warmup 2 \
		--rounds 2 --out bench-results/smoke
