# The README's two commands. `make setup` is what both need: a locked virtual environment (uv.lock)
# and the Fashion-MNIST IDX files from Debian's dataset-fashion-mnist package.
PY := .venv/bin/python
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup data demo test bench
setup: .venv/.synced data

.venv/.synced: pyproject.toml uv.lock
	command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
	uv sync --frozen --extra test
	touch $@

data: $(FMNIST)
$(FMNIST):
	@if [ "$$(id -u)" = 0 ]; then (apt-get update -qq || true) && apt-get install -y -qq dataset-fashion-mnist; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist; fi

# the main job: train FedRE on Fashion-MNIST with every exchange captured
demo: setup
	$(PY) -m privfl.train fedre
	$(PY) -m privfl.capture verify

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) experiments/bench_capture.py
