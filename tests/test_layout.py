"""The package's layers: a subpackage imports only the ones below it in the data flow."""

import ast
from pathlib import Path

import baft

PACKAGE = Path(baft.__file__).parent
BASE = {"errors", "jsonfile", "config", "teardown", "accelerator", "background", "faults"}
LAYERS = ["script", "pipeline", "snapshot", "position", "manager", "recovery"]  # bottom to top; cli, simulate, examples, plugin on top


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


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports by name (``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
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


FOREIGN = ("torch", "deepspeed")


def foreign_assignments(source: str) -> list[str]:
    """Where ``source`` assigns to (or deletes, or ``setattr``s) an attribute of something it imported from torch
    or DeepSpeed: a module global or class swapped for baft's own, which every user of it would see."""
    tree = ast.parse(source)
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] in FOREIGN}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            foreign |= {a.asname or a.name for a in node.names}

    def root(expr) -> str:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else ""

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        targets = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        found += [f"line {t.lineno}: {ast.unparse(t)}" for t in targets
                  if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in foreign]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and root(node.args[0]) in foreign:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_assigns_to_torch_or_deepspeed():
    """baft changes DeepSpeed's behaviour only through its own subclass and instruction map, never by
    swapping a torch or DeepSpeed module's globals (``p2p.recv``, ``torch.distributed.all_reduce``) in a rank."""
    assert sorted(foreign_assignments("import torch.distributed as dist\nfrom deepspeed.runtime.pipe import p2p\n"
                                      "dist.all_reduce = None\np2p.recv, x = None, 1\nsetattr(dist, 'recv', None)\n"
                                      "import torch\ntorch.distributed.send = None\n")) == [
        "line 3: dist.all_reduce", "line 4: p2p.recv", "line 5: setattr(dist, 'recv', None)", "line 7: torch.distributed.send"]
    # torchrun's own process, which no rank is: baft.cli.torchrun replaces functions of torch's rendezvous and
    # launcher there (its docstring says why), and no module of baft imports it but the command line's (``baft
    # torchrun``: that process is torchrun)
    launcher, command_line = PACKAGE / "cli" / "torchrun.py", PACKAGE / "cli" / "main.py"
    for path in sorted(PACKAGE.rglob("*.py")):
        found = foreign_assignments(path.read_text())
        if path == launcher:
            assert found and all(line.split(": ")[1].startswith(("dynamic_rendezvous.", "run_module.", "launcher_api."))
                                 for line in found), found
            continue
        assert not found, f"{path.relative_to(PACKAGE.parent)} assigns to torch or DeepSpeed: {found}"
        if path != command_line:
            assert "baft.cli.torchrun" not in imported_modules(path), f"{path.relative_to(PACKAGE.parent)} imports it"


def test_every_package_names_each_of_its_modules_in_its_map():
    """Each subpackage's docstring is its map (``- ``name``  what it holds``): a newcomer reads the folders from
    them, so a module missing from its map is a map gone stale."""
    import importlib

    stale = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = importlib.import_module(f"baft.{init.parent.name}").__doc__ or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__"))
        stale += [f"baft/{init.parent.name}/{name}.py" for name in modules if f"``{name}``" not in doc]
    assert stale == [], f"not in their package's map: {stale}"
