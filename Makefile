# The two commands of the README: `make demo` and `make test`. Both install first (idempotent).
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: install lint test test-quick test-docs docs demo bench study study-size clean

install:
	@bash scripts/install.sh $(VENV)

# ruff (config in pyproject.toml): lint and format check
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# every lane, on JOBS processes (pytest-xdist; a file's tests stay on one process, so its module fixtures are
# built once; the files with the most end-to-end runs first, see tests/conftest.py): 11 min on 2 cores against
# 23.5 serially (docs/development.md, "Test time")
JOBS ?= 2
test: lint
	$(PYTHON) -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder

test-quick: lint
	$(PYTHON) -m pytest -m "not slow and not docs"

# the docs lane alone: the site's build and every page's snippets (tests/docs)
test-docs: lint
	$(PYTHON) -m pytest -m docs

# the documentation site (docs/, Sphinx): warnings are errors, every reference must resolve; open
# docs/_build/html/index.html
docs: install
	$(VENV)/bin/sphinx-build -W -n --keep-going -b html docs docs/_build/html

demo: install
	$(PYTHON) scripts/demo.py

bench: install
	$(PYTHON) bench/bench_mixers.py
	$(PYTHON) bench/bench_ops.py
	$(PYTHON) bench/bench_tokenmix_sampler.py
	$(PYTHON) bench/bench_tl_align.py --repeats 15
	$(PYTHON) bench/bench_tokenmixup.py --repeats 5
	$(PYTHON) bench/bench_token_labels.py --images 64 --rounds 5 --step-model deit_tiny_patch16_224 --batch 32
	$(PYTHON) bench/bench_maps.py --model resnet50 --input-size 576 --batch-size 8 --images 32 --workers 2 --repeats 3

# the multi-seed study (bench/STUDY.md; preset cpu_small): about 85 min on 2 cores, resumable (rerun to continue)
study: install
	$(PYTHON) bench/study.py --out study_out

# the size study (bench/STUDY.md): CutMix, TL-Align, TransMix and TokenMix on worlds of small, medium and large
# objects, 5 seeds, and TL-Align vs CutMix over 16 seeds where area labels are most wrong; about 3 h on 2 cores,
# resumable (rerun to continue)
study-size: install
	$(PYTHON) bench/study_size.py --out study_size_out

clean:
	rm -rf demo_out
