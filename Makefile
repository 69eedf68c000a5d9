# The README's two commands. `make setup` is what both need: a locked virtual environment (uv.lock)
# and the Fashion-MNIST IDX files from Debian's dataset-fashion-mnist package.
# `make test` lints first (`make lint`: ruff check, ruff format --check, mypy) and stops at the first failure.
PY := .venv/bin/python
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup data demo lint format test bench
setup: .venv/.synced data

.venv/.synced: pyproject.toml uv.lock
	command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
	uv sync --frozen --compile-bytecode --extra test --extra flower
	touch $@

data: $(FMNIST)
$(FMNIST):
	@if [ "$$(id -u)" = 0 ]; then (apt-get update -qq || true) && apt-get install -y -qq dataset-fashion-mnist; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist; fi

# the main job: train FedRE on Fashion-MNIST with every exchange captured, then invert what one
# client sent beside its per-sample representations and prototypes (FedRE Figure 4), with the deep
# image prior and with the learned decoder, each read against the attacker's prior -> gallery + HTML.
# 1000 DIP steps (privfl's default since its DIP ablation, docs/attacks.md) keep it to minutes on a CPU.
DEMO_STEPS ?= 1000
demo: setup
	$(PY) -m privfl.train fedre
	$(PY) -m privfl.capture verify
	$(PY) -m privfl.attack invert --compare rep,proto,ent_rep --learned --steps $(DEMO_STEPS)

# the linters and the type checker, configured in pyproject.toml; they need the venv, not the data
lint: .venv/.synced
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	PYTHONPATH=. .venv/bin/lint-imports

# rewrite what the linters can fix themselves (then run `make lint` for what is left)
format: .venv/.synced
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: setup lint
	$(PY) -m pytest

bench: setup
	$(PY) -m experiments.bench.run_all
