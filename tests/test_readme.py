"""The README is the front door: its configuration table and its commands must match the code."""
from __future__ import annotations

import re

from conftest import ROOT


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_configuration_table_lists_every_setting():
    from worker.settings import WorkerSettings

    section = readme().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.MULTILINE))
    settings = {name.upper() for name in WorkerSettings.model_fields}
    assert documented == settings, (f"undocumented: {sorted(settings - documented)}; "
                                    f"documented but unknown: {sorted(documented - settings)}")


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", readme(), flags=re.DOTALL)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()
    run_command = next(c for c in commands if "--test_input" in c)
    assert run_command.startswith("bash scripts/install.sh && .venv/bin/python handler.py --test_input")
