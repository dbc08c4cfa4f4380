# The two commands a new user needs; both set up .venv first.
#   make pipeline   the Snakemake sweep on the embedded default (tiny DiTs, CPU, minutes)
#   make test       ruff, then the test suite (what CI runs)
#   make learning   the learning testbed: a DiT pre-trained on drawn scenes, GRPO per method x 3 seeds (docs/learning.md)
CORES ?= 2
PYTEST_ARGS ?=

.PHONY: setup pipeline test report clean learning
setup:
	@bash scripts/setup.sh

pipeline: setup
	.venv/bin/snakemake --cores $(CORES)
	.venv/bin/snakemake --cores $(CORES) --report results/report.html

learning: setup
	.venv/bin/snakemake learning --cores $(CORES) --configfile config/learning.yaml

test: setup
	.venv/bin/ruff check agg_bench baselines tests benchmarks scripts
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake
