#!/usr/bin/env bash
# The API tests against the newest releases of the official clients (openai, anthropic, openai-agents) instead of
# the pinned ones (tests/constraints.txt): upgrades them in .venv, runs the tests, then puts the pinned versions
# back so the suite's verdict stays the pinned one.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade openai anthropic openai-agents
.venv/bin/python -m pip list 2>/dev/null | grep -E "^(openai|anthropic|openai-agents) "
status=0
.venv/bin/python -m pytest -q tests/test_openai_conformance.py tests/test_messages_api.py tests/test_responses_api.py \
    "$@" || status=$?
"${pip[@]}" -c tests/constraints.txt openai anthropic openai-agents
exit $status
