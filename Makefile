# `make train` and `make test` each create .venv on first use and install jaxtron into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jaxtron-installed
CPU_DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu

.PHONY: train test install clean

install: $(STAMP)

# uv installs the same pinned packages as pip in half the time (it downloads and compiles in
# parallel); pip installs them where uv cannot be installed or fails.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==0.13.10 \
	    && $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -e '.[test]' \
	    || { $(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet -e '.[test]'; }
	touch $(STAMP)

train: $(STAMP)
	$(CPU_DEVICES) $(PY) -m jaxtron.train --config configs/tiny.yaml $(ARGS)

# Two pytest workers (pytest-xdist): the tests mostly compile, one core each.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
