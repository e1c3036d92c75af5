# Two entry points for a fresh machine:
#   make report   install everything, then run the whole pipeline on the embedded default model
#   make test     install everything (incl. test tools), then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= 2

.PHONY: install install-test report test lint bench wheelhouse clean

$(VENV)/.installed: pyproject.toml constraints.txt CMakeLists.txt $(wildcard csrc/*)
	bash scripts/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed

install-test: install
	bash scripts/install_system.sh

report: install
	$(VENV)/bin/snakemake --cores $(CORES) results/report.html

test: install-test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q

bench: install
	$(PY) benchmarks/bench_scan.py

# offline installs for scripts/device_check.sh on the GPU machine (Python 3.12, no registry)
wheelhouse:
	bash scripts/build_wheelhouse.sh --device .wheelhouse/device

clean:
	rm -rf build $(VENV) .snakemake results logs
