# The handful of verbs: setup, up, test, lint, bench, native.
PY := .venv/bin/python

.PHONY: setup up test test-fast lint format bench native native-cuda

setup:
	bash scripts/setup.sh

up: setup
	$(PY) scripts/up.py

test: setup
	bash scripts/test.sh

test-fast:
	$(PY) -m pytest -m "not slow" -q -p no:cacheprovider -n 3 --dist loadfile

lint:
	bash scripts/lint.sh

format:
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench:
	$(PY) bench/route.py
	-[ -f bench/native.py ] && $(PY) bench/native.py
	-[ -f bench/distribution.py ] && $(PY) bench/distribution.py

native:
	bash native/build.sh

# libggswarm on a CUDA ggml (sm_89 + sm_90) in native/build-cuda/; docs/native.md "The CUDA build"
native-cuda:
	bash native/build_cuda.sh
