# Two commands on a fresh machine:
#   make report   the main job: notebook 01 (layer parity) headless on the embedded tiny variant
#                 -> reports/01_layer_parity/01_layer_parity.html
#   make test     the whole test suite
# Each creates or updates the virtual env .venv first (pinned installs from constraints/cpu.txt).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.glmkit-installed

.PHONY: setup report report-grpo report-launch test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e ".[test]"
	touch $(STAMP)

report: setup
	$(VENV)/bin/glmkit report notebooks/01_layer_parity.ipynb --out reports/01_layer_parity -p variant tiny

report-grpo: setup
	$(VENV)/bin/glmkit report notebooks/02_smoke_grpo.ipynb --out reports/02_smoke_grpo -p model_name tiny

report-launch: setup
	$(VENV)/bin/glmkit report notebooks/03_multinode_launch.ipynb --out reports/03_multinode_launch

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_paths.py

clean:
	rm -rf $(VENV) reports .cache
