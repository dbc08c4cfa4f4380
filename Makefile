# The two commands a new user needs; both set up .venv first.
#   make pipeline   the Snakemake sweep on the embedded default (tiny DiTs, CPU, minutes)
#   make test       the test suite, tests/unit and tests/integration as two streams on two cores, with ruff,
#                   shellcheck and mypy beside them (scripts/test.sh; what CI runs)
#   make test-fast  ruff, shellcheck and mypy, then tests/unit only (in-process, a few minutes)
#   make learning   the learning testbed: a DiT pre-trained on drawn scenes, GRPO per method x 3 seeds (5 for full and AGG; docs/learning.md)
#   make clean      removes what the workflows made in results/ (not results/reference/), and .snakemake/
# the recipes take paths in the clone: `make -f CLONE/Makefile` from another folder ran them there and failed
ifeq ($(filter Makefile ./Makefile $(CURDIR)/Makefile,$(firstword $(MAKEFILE_LIST))),)
$(error make runs in the clone: make -C $(patsubst %/Makefile,%,$(MAKEFILE_LIST)) $(MAKECMDGOALS), not make -f from $(CURDIR))
endif
CORES ?= 2
PYTEST_ARGS ?=
# CORES is a whole number of cores from 1, or all: Snakemake waits forever for a job to fit in --cores 0, and takes
# a negative count, which reached the jobs as OMP_NUM_THREADS. Checked before the set-up runs: one line, exit 2.
ifneq ($(filter pipeline learning,$(MAKECMDGOALS)),)
ifeq ($(shell case '$(subst ','',$(CORES))' in (all|[1-9]|[1-9][0-9]|[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9]) echo ok;; esac),)
$(error CORES=$(CORES): expected a whole number of cores from 1 to 9999, or all)
endif
endif
# Snakemake starts the workflow's jobs through a shell with the interpreter's path (.venv/bin/python here)
# unquoted; said before the set-up instead of after it (the Snakefile refuses too, for snakemake run by hand).
# make test too: its end-to-end tests run workflows, and failed on that refusal after the set-up and minutes of
# tests; the unit tests (make test-fast) run no workflow.
empty :=
space := $(empty) $(empty)
ifneq ($(filter pipeline learning test,$(MAKECMDGOALS)),)
ifneq ($(findstring $(space),$(CURDIR)),)
$(error the clone's path "$(CURDIR)" holds a space, and Snakemake starts the workflow's jobs through a shell with .venv/bin/python's path unquoted$(if $(filter test,$(MAKECMDGOALS)), (make test runs workflows; make test-fast runs the unit tests alone)): clone the repository where the path has no space)
endif
endif
# these write results/, .snakemake/ and the linters' and pytest's caches in the clone
ifneq ($(filter pipeline learning test test-fast lint,$(MAKECMDGOALS)),)
ifneq ($(shell test -w . || echo no),)
$(error cannot write in $(CURDIR) (permissions, or a read-only file system), where make $(filter pipeline learning test test-fast lint,$(MAKECMDGOALS)) writes its results and caches: clone the repository where you can write)
endif
endif

.PHONY: setup pipeline test test-fast lint clean learning
setup:
	@bash scripts/setup.sh

# one workflow of a clone at a time: a second make pipeline waits for the first (scripts/one-workflow.sh)
ONE = @bash scripts/one-workflow.sh
pipeline: setup
	$(ONE) .venv/bin/snakemake --cores $(CORES)
	$(ONE) .venv/bin/snakemake --cores $(CORES) --report results/report.html

learning: setup
	$(ONE) .venv/bin/snakemake learning --cores $(CORES) --configfile config/learning.yaml

# every shell script of the repository (tests/integration/test_workflow_files.py checks that none is missing);
# .shellcheckrc has shellcheck follow what they source
SHELL_SCRIPTS = .ci/run $(sort $(wildcard scripts/*.sh))
RUFF = .venv/bin/ruff check agg_bench baselines tests benchmarks scripts
SHELLCHECK = .venv/bin/shellcheck $(SHELL_SCRIPTS)
MYPY = .venv/bin/mypy
lint: setup
	$(RUFF)
	$(SHELLCHECK)
	$(MYPY)

# PYTHON in the environment chose the interpreter that made .venv (scripts/setup.sh), not the one that tests
# read. The lint steps run beside the test streams (scripts/test.sh prints their report after the tests'):
# mypy from nothing takes about 25 s of one core, which before the streams left the other core idle.
test: setup
	PYTHON=.venv/bin/python AGG_BENCH_TEST_LINT='$(RUFF) && $(SHELLCHECK) && $(MYPY)' bash scripts/test.sh $(PYTEST_ARGS)

test-fast: lint
	.venv/bin/python -m pytest -q tests/unit $(PYTEST_ARGS)

# What the workflows write in results/ (and their temporary names, .NAME.agg-bench-tmpPID-RUN): the rest stays, the
# committed reference results in results/reference/ among it, and so do files of the user's there (said in one
# line), which `make clean` removed with the rest.
RESULTS = benchmarks calibration cells done embeddings gradcheck imported learning logs manifest.json plots \
	pretrained report.html runs tables
clean:
	rm -rf .snakemake
	@if [ -d results ]; then cd results && rm -rf $(RESULTS) && find . -mindepth 1 -maxdepth 1 -name '.*.agg-bench-tmp*' \
	  -exec rm -rf {} + && kept=$$(ls -A | grep -vx reference | paste -sd ' ' -) && if [ -n "$$kept" ]; then \
	  echo "make clean: kept what is not the workflows' in results/: $$kept"; fi; fi
