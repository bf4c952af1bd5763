# The two commands a newcomer needs (README.md): `make demo` and `make test`.
.PHONY: setup browser services demo test unit

XFW := .venv/torch/bin/xfw
PYTEST := .venv/torch/bin/python -m pytest

# .venv/torch, .venv/paddle and .venv/jax (scripts/setup_jax.sh), built side by side; then this tree's own modules
# compiled once: an interpreter that may not write its bytecode cache (PYTHONDONTWRITEBYTECODE, set on the machines
# this suite is measured on) otherwise compiles every xfw module it imports again in every process it starts (pip
# compiles the environments' packages as it installs them). Quick when nothing changed; a module edited later is
# compiled in memory as before (its cached bytecode no longer matches).
setup:
	bash scripts/setup.sh
	.venv/torch/bin/python -m compileall -q xfw adapters tests scripts

# Debian's chromium, for the test that opens the nightly report in a real headless browser.
browser:
	bash scripts/setup_browser.sh

# What only the tests need, from Debian (apt): chromium, then a real two-node Slurm cluster on loopback for
# tests/contract/test_slurm.py (docs/slurm.md). `make test` installs it while `setup` builds the Python
# environments (pip and apt share nothing; scripts/setup.sh builds the three environments side by side).
services: browser
	bash scripts/setup_slurm.sh

# A tiny LLaVA SFT on CPU, Paddle vs PyTorch: the seed-003 table on stdout, chart and runs in runs/demo.
# Its language model at hidden size 384 and 48 measured steps, so each side's window passes the 5 s its report
# trusts (the recipe as written measures 0.5-3 s and warns; issue 42) and the demo stays about as fast as the
# recipe as written (46 s): at 384/40 steps, measured twice at load 2, 39-42 s with windows paddle 14-17 s,
# torch 6.3 s; 48 steps keep torch over 5 s on a quieter machine. Hidden 512/24 steps took 100 s.
demo: setup
	$(XFW) compare recipes/tiny/llava_sft.yaml --backends paddle,torch --out runs/demo \
		--set model.arch.text.hidden_size=384 --set model.arch.text.intermediate_size=768 --set measure.steps=48

# Everything: unit tests (no framework) and contract tests (real adapters, tiny models, CPU), in
# three workers on CI's two cores (a test file's functions stay in one, so its module fixtures are built once; a class
# is a scope of its own, tests/conftest.py), longest scopes first (tests/durations.json; --no-loadscope-reorder, or xdist
# re-sorts the scopes by their number of tests and the one-test long scopes go last). A worker waits on its runs'
# processes (starting, polling, Slurm's one-minute time limit): a third keeps both cores busy, for a little more CPU
# (about even with two, measured side by side: docs/testing.md). WORKERS=0: serial; JUNIT=FILE keeps per-test
# times for scripts/test_durations.py.
WORKERS ?= 3
test:
	$(MAKE) --no-print-directory -j2 setup services
	$(PYTEST) tests $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadscope --no-loadscope-reorder) --durations=25 $(if $(JUNIT),--junitxml=$(JUNIT))

unit: setup
	$(PYTEST) tests/unit
