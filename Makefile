# Two commands on a fresh machine:
#   make report   the main job: glmkit check on the embedded tiny variant -> reports/check/check.html
#   make test     the whole test suite
# Each creates or updates the virtual env .venv first (pinned installs from constraints/cpu.txt).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.glmkit-installed

.PHONY: setup report test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e ".[test]"
	touch $(STAMP)

report: setup
	$(VENV)/bin/glmkit check --variant tiny --out reports/check

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_paths.py

clean:
	rm -rf $(VENV) reports .cache
