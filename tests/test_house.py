"""The package's floors, drawn from its imports: no circles, and no arrow from a lower floor up to a higher one.

Every `import` counts, including those inside functions and under `if TYPE_CHECKING:`, because each is a
dependency a reader has to follow. Also: no file refers to a document outside the repository.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# The folder each package's modules live in: experiments/ and analysis/ install as moe_rl.experiments and
# moe_rl.analysis (pyproject.toml, [tool.setuptools] package-dir).
PACKAGES = {"moe_rl": "moe_rl", "moe_rl.experiments": "experiments", "moe_rl.analysis": "analysis"}

# Bottom to top, one floor a folder (docs/design.md section 3). A module may import its own floor (without circles)
# and the floors below it.
FLOORS = [
    ("base", ("moe_rl", "moe_rl.errors", "moe_rl.runs")),
    ("model, tasks and objectives", ("moe_rl.model", "moe_rl.tasks", "moe_rl.objectives")),
    ("kernels", ("moe_rl.kernels",)),
    ("routing", ("moe_rl.routing",)),
    ("the RL step", ("moe_rl.rl",)),
    ("commands", ("moe_rl.commands",)),
    ("sweeps", ("moe_rl.sweep",)),
    ("experiments, analysis and the CLI", ("moe_rl.cli", "moe_rl.experiments", "moe_rl.analysis")),
]


def module_name(path: Path, package: str, folder: str) -> str:
    parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path, package, folder): path
            for package, folder in PACKAGES.items() for path in sorted((ROOT / folder).rglob("*.py"))}


def test_pyproject_installs_every_package_folder():
    """setuptools is given the package list by hand (the two folders outside moe_rl/ need it): a new subpackage
    missing from it would be left out of an install, and work only in the checkout."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    found = {module_name(init, package, folder) for package, folder in PACKAGES.items()
             for init in (ROOT / folder).rglob("__init__.py")}
    assert set(setuptools["packages"]) == found
    assert setuptools["package-dir"] == {p: f for p, f in PACKAGES.items() if p != f}


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (the longest known prefix of each imported name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                found.add(".".join(parts[:n]))
                break
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def floor_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(FLOORS):
        # "moe_rl" alone is the package's (empty) __init__, not a prefix of everything
        if any(module == p or (p != "moe_rl" and module.startswith(p + ".")) for p in prefixes):
            return level
    raise AssertionError(f"{module} belongs to no floor; add it to FLOORS in tests/test_house.py")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_every_module_has_a_floor():
    for module in all_modules():
        floor_of(module)


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_arrows_up():
    up = [f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
          for a, targets in import_graph().items() for b in targets if floor_of(b) > floor_of(a)]
    assert not up, "lower floors import higher ones:\n" + "\n".join(up)


def test_no_package_level_circles():
    """Between subpackages too (moe_rl.sweep <-> experiments would be one, even without a module circle)."""
    def unit(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == "moe_rl" and len(parts) > 2 else parts[0] if parts[0] != "moe_rl" \
            else module

    packages: dict[str, set[str]] = {}
    for a, targets in import_graph().items():
        packages.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    cycle = find_cycle(packages)
    assert cycle is None, "package circle: " + " -> ".join(cycle)


def test_the_checker_finds_circles_and_arrows_up():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert floor_of("moe_rl.runs.runlog") < floor_of("moe_rl.commands.train") < floor_of("moe_rl.sweep.jobs")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_no_references_to_documents_outside_the_repository():
    out = subprocess.run(["git", "grep", "-n", "-I", "-E", r"DESIGN\.md|\.\./shared|STYLE\.md", "--", ".",
                          ":!tests/test_house.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", "references to documents users do not have:\n" + out.stdout
