"""The package's layers: a subpackage imports only the ones below it in the data flow."""

import ast
from pathlib import Path

import baft

PACKAGE = Path(baft.__file__).parent
BASE = {"errors", "jsonfile", "config", "teardown", "accelerator", "background"}
LAYERS = ["pipeline", "snapshot", "manager", "recovery"]  # bottom to top; cli, simulate, examples, plugin on top


def imported_packages(path: Path) -> set[str]:
    """The baft subpackages (or top-level modules) a file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "baft":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("baft.")}
    return found


def test_lower_layers_never_import_higher_ones():
    for level, layer in enumerate(LAYERS):
        allowed = BASE | set(LAYERS[:level + 1])
        for path in sorted((PACKAGE / layer).glob("*.py")):
            wrong = imported_packages(path) - allowed
            assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports baft.{', baft.'.join(sorted(wrong))}"


def test_the_base_modules_import_nothing_above_them():
    for name in BASE:
        wrong = imported_packages(PACKAGE / f"{name}.py") - BASE
        assert not wrong, f"baft/{name}.py imports baft.{', baft.'.join(sorted(wrong))}"


def test_the_simulator_uses_the_same_timeline_and_planner_and_nothing_above():
    for path in (PACKAGE / "simulate").glob("*.py"):
        wrong = imported_packages(path) - BASE - {"pipeline", "snapshot", "simulate"}
        assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports baft.{', baft.'.join(sorted(wrong))}"
