# The two commands a new user needs; both set up .venv first.
#   make pipeline   the Snakemake sweep on the embedded default (tiny DiTs, CPU, minutes)
#   make test       the test suite (what CI runs)
CORES ?= 2
PYTEST_ARGS ?=

.PHONY: setup pipeline test report clean
setup:
	@bash scripts/setup.sh

pipeline: setup
	.venv/bin/snakemake --cores $(CORES)
	.venv/bin/snakemake --cores $(CORES) --report results/report.html

test: setup
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake
