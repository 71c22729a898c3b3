"""Which package may import which, read from the source with `ast` (nothing is imported, so this runs in a blink).

    engine         imports neither of the others (it knows nothing of OpenAI JSON or of the process)
    openai_compat  imports the engine through its one door, `engine` (engine/__init__.py's __all__), never worker
    worker         imports both, the engine through the same door

Every import counts: module level, inside functions, and under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages of the project and the others of them each may import.
MAY_IMPORT = {
    "engine": set(),
    "openai_compat": {"engine"},
    "worker": {"engine", "openai_compat"},
}
# Packages that must take the engine only as `engine` (what engine/__init__.py exports), not engine.<subpackage>.
THROUGH_THE_DOOR = ("openai_compat", "worker")


def modules(package: str) -> dict[str, Path]:
    """Every module of a package by dotted name."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for each import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, [alias.name for alias in node.names], node.lineno))
    return found


def engine_exports() -> set[str]:
    """engine/__init__.py's __all__, read from its source."""
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("engine/__init__.py has no __all__")


def test_the_packages_are_where_the_test_looks():
    assert {"openai_compat.jobs", "openai_compat.chat.render", "openai_compat.routes"} <= set(modules("openai_compat"))
    assert {"engine", "engine.loader", "engine.device_check", "engine.settings"} <= set(modules("engine"))
    assert {"worker.gateway", "worker.handler", "worker.settings"} <= set(modules("worker"))
    assert "openai_compat.server" not in modules("openai_compat")  # the gateway is worker.gateway


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_package_imports_only_the_packages_below_it(package):
    wrong = []
    for module, path in modules(package).items():
        for target, _, line in imports(module, path):
            top = target.split(".")[0]
            if top in MAY_IMPORT and top != package and top not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", THROUGH_THE_DOOR)
def test_the_engine_is_imported_only_through_its_door(package):
    exported = engine_exports()
    wrong = []
    for module, path in modules(package).items():
        for target, names, line in imports(module, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target.startswith("engine."):
                wrong.append(f"{where} imports {target}: export what it needs from engine/__init__.py")
            elif target == "engine":
                wrong += [f"{where} imports engine.{name}, which engine/__init__.py does not export"
                          for name in names if name not in exported]
    assert not wrong, "\n".join(wrong)


def test_the_engine_exports_what_it_names():
    """Every name in engine.__all__ resolves through the door (a typo there would break it), and importing one
    engine module does not import the rest: engine/__init__.py imports its exports on first use."""
    import subprocess
    import sys
    probe = ("import sys, engine; names = sorted(engine.__all__); missing = [n for n in names if "
             "getattr(engine, n, None) is None]; print(missing)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.split() == ["[]"], result.stdout + result.stderr[-2000:]
    lazy = ("import sys; import engine.cpu.native_kernels; "
            "print(sorted(m for m in ('engine.async_engine', 'engine.tokenizer', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", lazy], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["[]"], result.stdout + result.stderr[-2000:]
