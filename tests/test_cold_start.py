"""Cold start (issue 27, item 7): the start-up probes' and checks' verdicts are kept in BASE_PATH, keyed by CPU,
model and versions, so a second start on the same volume runs none of them; a corrupt verdict file is ignored
and rewritten; the served output does not depend on whether the verdicts were probed or reused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PARIS_REQUEST, ROOT

JOB = json.dumps({"input": {"openai_route": "/v1/chat/completions", "openai_input": PARIS_REQUEST}})


@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> Path:
    """A fresh BASE_PATH with the default one's converted GGUF models and native kernel builds linked in (neither
    the conversion nor the compiler is under test: a build takes a minute of the suite)."""
    from engine.config import EngineConfig
    from engine.cpu import native_kernels
    from engine.loader import model_folder
    from worker.settings import load_settings

    default = load_settings().base_path
    model_folder(EngineConfig(cache_dir=default))
    base = tmp_path_factory.mktemp("volume")
    (base / "converted").symlink_to(default / "converted")
    native_kernels.build(cache_dir=default)  # this CPU's build there (install.sh made it: found at once)
    (base / "native-kernels").symlink_to(native_kernels.build_dir(default))
    return base


def _start(base: Path) -> tuple[str, str]:
    """One real worker process on `base` under DTYPE=auto (every CPU probe runs): its answer and its log."""
    env = {**os.environ, "BASE_PATH": str(base), "DTYPE": "auto", "LOG_LEVEL": "INFO"}
    env.pop("STARTUP_CACHE", None)
    done = subprocess.run([sys.executable, "handler.py", "--test_input", JOB], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    return result["output"][0]["choices"][0]["message"]["content"], done.stderr


def _verdict_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "start-up verdicts:" in line and "reused" in line]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


@pytest.mark.slow
def test_second_start_reuses_every_verdict_and_a_corrupt_file_is_probed_again(base_path):
    first, log = _start(base_path)
    line = _verdict_line(log)
    assert " 0 reused" in line and " 0 probed" not in line, line
    for probe in ("bfloat16_gain", "cpu_layout", "gguf_blocks", "native_self_check", "compact_forward"):
        assert probe in line, line
    (stored,) = (base_path / "startup-verdicts").glob("model-*.json")

    again, log = _start(base_path)
    line = _verdict_line(log)
    assert " 0 probed (none)" in line and " 0 reused" not in line, line
    # The probes' own log lines are absent: none timed anything on this start.
    assert "against bfloat16 products" not in log
    # Nor does it make oneDNN copies of the weights that the block or bfloat16 products serve at every size, only
    # to release them (the first start may: it learns which products serve only after the layout is set).
    assert "copies released" not in log
    assert again == first

    stored.write_text('{"identity": {"format": 1}, "verdicts": ', encoding="utf-8")  # a write cut short
    third, log = _start(base_path)
    assert "ignoring" in log and " 0 reused" in _verdict_line(log)
    assert json.loads(stored.read_text(encoding="utf-8"))["verdicts"]  # rewritten whole
    assert third  # re-probed on a busy machine, the timing verdicts may differ: the answer need not be the same


def test_a_verdict_file_of_another_key_is_ignored(tmp_path):
    from engine import startup_cache

    kept = startup_cache.Verdicts(tmp_path, {"cpu": "a"}, "model")
    assert kept.get("probe", lambda: 3) == 3 and kept.misses == ["probe"]
    kept.save()
    assert startup_cache.Verdicts(tmp_path, {"cpu": "a"}, "model").get("probe", lambda: 4) == 3
    # Another CPU's file, renamed into this key's place (a volume shared by machines, a digest collision).
    other = startup_cache.Verdicts(tmp_path, {"cpu": "b"}, "model")
    other.get("probe", lambda: 5)
    other.save()
    os.replace(other.path, kept.path)
    again = startup_cache.Verdicts(tmp_path, {"cpu": "a"}, "model")
    assert again.get("probe", lambda: 6) == 6 and again.misses == ["probe"]
    assert not [p for p in kept.path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
