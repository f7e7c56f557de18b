# Two entry points: `make demo` runs the main demo end to end, `make test` runs every check.
# Both create (or reuse) .venv and install what they need, torch pinned by requirements/ci.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench bench-quick clean base-install gpu-wheels gpu-check

$(STAMP): pyproject.toml requirements/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/ci.txt
	# DS_BUILD_OPS=0: DeepSpeed installs as pure Python; its tests compile only the CPU comm op.
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -c requirements/ci.txt -e ".[test,docs]"
	touch $(STAMP)

# The peers the benchmarks compare with (torchmetrics, Lightning, Accelerate) are not needed by
# `make test`; only the bench targets install them, torch still pinned by requirements/ci.txt.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c requirements/ci.txt -e ".[bench]"
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(PY) demo/run.py

lint: $(STAMP)
	$(PY) -m ruff check danling tests demo benchmarks
	$(PY) -m ruff format --check danling tests demo benchmarks

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# A second environment with only the core dependencies proves `import danling` needs no extra.
BASE_VENV ?= .venv-base
base-install: $(STAMP)
	test -x $(BASE_VENV)/bin/python || $(PYTHON) -m venv $(BASE_VENV)
	$(BASE_VENV)/bin/python -m pip install --quiet -r requirements/ci.txt
	$(BASE_VENV)/bin/python -m pip install --quiet -c requirements/ci.txt .
	cd /tmp && $(CURDIR)/$(BASE_VENV)/bin/python -c "import sys, danling; \
	bad = [m for m in ('tensorboard', 'wandb', 'deepspeed', 'pandas', 'matplotlib', 'mlflow', 'torchft') if m in sys.modules]; \
	assert not bad, bad; print('base install imports danling', danling.__version__, 'without extras')"

test: lint docs base-install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# `make bench` runs every benchmark of docs/benchmarks.md with its defaults (about an hour);
# `make bench-quick` (or `make bench QUICK=1`) runs a short version of each in under 2 minutes.
BENCH := OMP_NUM_THREADS=1 $(PY)
BENCH_PAGE := runner step_overhead metrics metric_inloop metric_overhead metric_containers peers startup loader tensors checkpoint parallel deepspeed

bench: $(BENCH_STAMP)
ifeq ($(QUICK),1)
	$(MAKE) bench-quick
else
	for name in $(BENCH_PAGE); do $(BENCH) benchmarks/bench_$$name.py || exit 1; done
endif

bench-quick: $(BENCH_STAMP)
	$(BENCH) benchmarks/bench_checkpoint.py --quick
	$(BENCH) benchmarks/bench_metric_overhead.py --number 300 --repeats 3
	$(BENCH) benchmarks/bench_metric_containers.py --quick
	$(BENCH) benchmarks/bench_peers.py --quick
	$(BENCH) benchmarks/bench_startup.py --quick
	$(BENCH) benchmarks/bench_loader.py --quick
	$(BENCH) benchmarks/bench_runner.py --quick --only first-step
	$(BENCH) benchmarks/bench_runner.py --quick --only training --method lockstep --workload "small MLP, batch 32"

clean:
	rm -rf site build *.egg-info

# The GPU device check (docs/gpu.md). `make gpu-wheels`, on a machine with a package index, fetches
# the pure-Python packages danling needs that the GPU image lacks, at the versions .venv holds, into
# $(GPU_WHEELS) (git-ignored). `make gpu-check`, on the GPU machine (no network), installs them and
# danling (without dependencies) into $(GPU_SITE) for the image's own Python, then runs every check.
GPU_WHEELS ?= .gpu-wheels
GPU_PY ?= python3
GPU_SITE ?= /tmp/danling-gpu-site
GPU_OUT ?= gpu-check-out
# torchao (the `fp8` extra) at a version whose float8 training runs with the image's torch 2.11.
GPU_TORCHAO ?= torchao==0.17.0
# setuptools to build danling with there, kept apart in $(GPU_BUILD) (the checks never import it):
# pyproject's SPDX `license` needs 77 or later, and an image's own setuptools may be older.
GPU_SETUPTOOLS ?= setuptools==84.2.1
GPU_BUILD ?= /tmp/danling-gpu-build
GPU_PLATFORMS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: $(GPU_PLATFORMS) -d $(GPU_WHEELS) \
		$$($(PY) -m pip freeze | grep -iE '^(chanfig|torchdata|lazy[-_]imports)==') $(GPU_TORCHAO)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d $(GPU_WHEELS)/build $(GPU_SETUPTOOLS)
	ls $(GPU_WHEELS) $(GPU_WHEELS)/build

gpu-check:
	@test -n "$$(ls $(GPU_WHEELS)/*.whl 2>/dev/null)" || { echo "no wheels in $(GPU_WHEELS): run 'make gpu-wheels' where pip reaches an index"; exit 1; }
	$(GPU_PY) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	@test -n "$$(ls $(GPU_WHEELS)/build/setuptools-*.whl 2>/dev/null)" || { echo "no setuptools wheel in $(GPU_WHEELS)/build: run 'make gpu-wheels' again"; exit 1; }
	$(GPU_PY) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_BUILD) $(GPU_WHEELS)/build/setuptools-*.whl
	PYTHONPATH=$(GPU_BUILD) $(GPU_PY) -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .
	cd /tmp && PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c "import danling, chanfig, torchdata; print('danling', danling.__version__, 'from', danling.__file__)"
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PY) benchmarks/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)
