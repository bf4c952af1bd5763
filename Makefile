# The two commands a newcomer needs (README.md): `make demo` and `make test`.
.PHONY: setup browser demo test unit

XFW := .venv/torch/bin/xfw
PYTEST := .venv/torch/bin/python -m pytest

setup:
	bash scripts/setup.sh

# Debian's chromium, for the test that opens the nightly report in a real headless browser.
browser:
	bash scripts/setup_browser.sh

# A tiny LLaVA SFT on CPU, Paddle vs PyTorch: the seed-003 table on stdout, chart and runs in runs/demo.
demo: setup
	$(XFW) compare recipes/tiny/llava_sft.yaml --backends paddle,torch --out runs/demo

# Everything: unit tests (no framework) and contract tests (real adapters, tiny models, CPU).
test: setup browser
	$(PYTEST) tests

unit: setup
	$(PYTEST) tests/unit
