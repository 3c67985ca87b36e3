# Two commands on a fresh machine:
#   make report   the main job: notebook 01 (layer parity) headless on the embedded tiny variant
#                 -> reports/01_layer_parity/01_layer_parity.html
#   make test     the whole test suite
# Each creates or updates the virtual env .venv first (pinned installs from constraints/cpu.txt).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.glmkit-installed

.PHONY: setup report report-grpo report-launch test test-threads bench gpu-bundle gpu-bundle-ray clean

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

# The numerically sensitive files (training, data parallel, parity) again on one thread with torch's
# deterministic algorithms: a test whose result moves with the thread count fails here (CI runs both).
NUMERIC_TESTS := tests/test_train.py tests/test_parallel.py tests/test_grpo.py tests/test_parity.py tests/test_model_parity.py
test-threads: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 GLMKIT_TEST_DETERMINISTIC=1 $(PY) -m pytest -q $(NUMERIC_TESTS)

bench: setup
	$(PY) benchmarks/bench_paths.py

# The device machine's extra packages (.gpu/, git-ignored; see ../shared/tools/gpu-bundle): fla,
# tilelang and transformers by the tool's defaults, plus what `glmkit serve` needs there (the GPU
# image has no fastapi or uvicorn), at the versions the CPU venv installs (constraints/cpu.txt).
GPU_SERVE_PINS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.55.0 \
	h11==0.16.0 anyio==4.16.0 annotated-types==0.8.0 typing-inspection==0.4.5 click==8.5.1 typing_extensions==4.16.0 \
	opentelemetry-api==1.45.2 annotated-doc==0.0.7 idna==3.20

gpu-bundle:
	../shared/tools/gpu-bundle $(GPU_SERVE_PINS)

# .gpu-ray/: fla and Ray for the Ray runs on the device machine (its image has no Ray)
gpu-bundle-ray:
	bash scripts/gpu_bundle_ray.sh

clean:
	rm -rf $(VENV) reports .cache
