"""What ``baft train`` checks of a script's launch before it starts a manager or a rank.

A mistake found here is one line naming the file or key; found on the ranks, it would be every
rank's traceback, and a launch that starts managers and ranks only to stop them.
"""

from __future__ import annotations

import ast
import os
import sys
from importlib.machinery import PathFinder
from typing import Optional

from baft.config import parse_config
from baft.errors import ConfigError
from baft.jsonfile import read_bytes, read_json

CONFIG_FLAGS = ("--deepspeed_config", "--config")
EXAMPLE = "baft.examples.worker"


def check_script_launch(command: list[str]) -> None:
    """Refuse a launch command (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) whose script cannot be read, or whose
    DeepSpeed config, named among its arguments, cannot be read or has a ``"baft"`` section the ranks would refuse."""
    if command[0] == "-m":  # a module its ranks find on their path, or say they cannot
        args = command[2:]
    elif command[0].startswith("-"):  # torchrun's own options: no script to check
        return
    else:
        interpreter = os.path.basename(command[0]).startswith("python") and not command[0].endswith(".py")
        if interpreter and not os.path.isfile(command[0]):
            raise ConfigError(f"{command[0]}: baft train runs the script with torchrun, which starts Python itself: "
                              f"drop {command[0]!r} from the command (baft train -- {' '.join(command[1:2])} ...)")
        check_readable(command[0])
        args = command[1:]
    for path in config_files(args):
        check_baft_section(path)


def script_source(command: list[str]) -> Optional[str]:
    """The source file a launch command runs: ``SCRIPT``, or for ``-m MODULE`` the file ``python -m`` would run
    (the working directory first on the path, a package's ``__main__``), found without importing anything; None
    where there is none to read (the ranks say why)."""
    if command[0] != "-m":
        return None if command[0].startswith("-") else command[0]
    if len(command) < 2:
        return None
    parts, spec, locations = command[1].split("."), None, [os.getcwd(), *sys.path]
    for depth in range(1, len(parts) + 1):
        spec = PathFinder.find_spec(".".join(parts[:depth]), locations) if locations is not None else None
        if spec is None:  # not found, or a module named as a package
            return None
        locations = spec.submodule_search_locations
    if locations is not None:  # a package: python -m runs its __main__
        spec = PathFinder.find_spec(f"{command[1]}.__main__", locations)
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def unprotected_initialize(path: str) -> Optional[str]:
    """Where a script calls ``deepspeed.initialize`` and never names ``baft.initialize`` (one line: its ranks would
    take no snapshots), or None. A script that reaches either only through modules of its own is not judged."""
    try:
        tree = ast.parse(read_bytes(path, expected="a training script"), filename=path)
    except (SyntaxError, ValueError):  # the script's own error, which its ranks report
        return None
    aliases = {"deepspeed": set(), "baft": set()}  # names bound to the module
    functions = {"deepspeed": set(), "baft": set()}  # names bound to its initialize
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in aliases:
                    aliases[alias.name].add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module in functions:
            functions[node.module].update(a.asname or a.name for a in node.names if a.name == "initialize")

    def names_initialize(expr, module: str) -> bool:
        if isinstance(expr, ast.Attribute):
            return expr.attr == "initialize" and isinstance(expr.value, ast.Name) and expr.value.id in aliases[module]
        return isinstance(expr, ast.Name) and expr.id in functions[module]

    if any(names_initialize(node, "baft") for node in ast.walk(tree)):
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and names_initialize(node.func, "deepspeed")]
    if not calls:
        return None
    line = min(call.lineno for call in calls)
    return (f"{path}:{line} calls deepspeed.initialize, not baft.initialize: its ranks take no snapshots, and a "
            "restart begins again at step 0 (baft.initialize takes the same arguments)")


def check_readable(path: str) -> None:
    """A one-line error naming ``path`` unless it is a file this process can read."""
    read_bytes(path, expected="a training script")


def config_files(args: list[str]) -> list[str]:
    """The DeepSpeed configs a script's arguments name: ``--deepspeed_config FILE`` (or ``=FILE``), and
    ``--config FILE`` where FILE ends in ``.json`` (a script's ``--config`` may be a YAML file of its own)."""
    found = []
    for i, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if flag not in CONFIG_FLAGS or not sep and i + 1 == len(args):
            continue
        value = value if sep else args[i + 1]
        if flag == "--deepspeed_config" or value.endswith(".json"):
            found.append(value)
    return found


def wraps_optimizer(command: list[str]) -> Optional[bool]:
    """Whether DeepSpeed wraps the optimizer of a script launched as ``SCRIPT ARGS...`` (bf16, fp16 or a ZeRO
    stage, by the configs its arguments name; where they name none, False for a script that builds its config and
    names none of those, :func:`_builds_plain_config`); None where that cannot be told."""
    configs = [read_json(path) for path in config_files(command[1:])]
    if not configs:
        return False if _builds_plain_config(command[0]) else None

    def section(doc: dict, *keys: str) -> dict:
        found = next((doc[key] for key in keys if key in doc), {})
        return found if isinstance(found, dict) else {}

    return any(section(doc, "bf16", "bfloat16").get("enabled") is True or section(doc, "fp16").get("enabled") is True
               or section(doc, "zero_optimization").get("stage", 0) not in (0, None) for doc in configs)


WRAPPING_KEYS = {"bf16", "bfloat16", "fp16", "zero_optimization"}
BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu"}


def _builds_plain_config(path: str) -> bool:
    """Whether the script at ``path`` writes its DeepSpeed config as a dict (one with a batch size key) and no string
    of it is a key that makes DeepSpeed wrap the optimizer or a JSON file's name (a config read from a file)."""
    try:
        tree = ast.parse(read_bytes(path, expected="a training script"), filename=path)
    except (SyntaxError, ValueError, ConfigError):  # the script's own error, which its ranks report
        return False
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    builds = any(isinstance(node, ast.Dict) and BATCH_KEYS & {getattr(key, "value", None) for key in node.keys}
                 for node in ast.walk(tree))
    return builds and not strings & WRAPPING_KEYS and not any(string.endswith(".json") for string in strings)


def check_baft_section(path: str) -> None:
    """A ConfigError naming ``path`` unless it is a JSON file whose ``"baft"`` section (if any) is valid."""
    doc = read_json(path)  # names the file when it cannot be read or parsed
    try:
        parse_config(doc)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def later_imports(in_place: bool, example_model, command) -> str:
    """When the warm server imports what DeepSpeed imports as it wraps an optimizer
    (:data:`baft.warm.preload.LATER_CHOICES`): before it forks, where the job wraps it (the example's ``--precision``
    and ``--zero-stage``, given as ``example_model`` or read from ``-m baft.examples.worker ARGS``; the DeepSpeed
    config a script's or module's arguments name) or recovers in place; never where it does not; once idle where the
    config is not known."""
    if in_place:
        return "now"
    if example_model is None and list(command[:2]) == ["-m", EXAMPLE]:
        example_model = _example_options(list(command[2:]))
    if example_model is not None:
        wraps = example_model["precision"] != "fp32" or example_model["zero_stage"] > 0
    else:
        script = list(command[1:] if command[0] == "-m" else command)  # a module's arguments as a script's
        wraps = wraps_optimizer(script) if script and not script[0].startswith("-") else None
    return {True: "now", False: "never", None: "idle"}[wraps]


def _example_options(argv: list[str]) -> Optional[dict]:
    """The bundled example's precision and ZeRO stage from its arguments (read here: importing the example imports
    DeepSpeed, seconds of the launcher's start), or None where they are wrong (its ranks say how)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--precision", default="fp32")  # the example's defaults
    parser.add_argument("--zero-stage", type=int, default=0)
    try:
        return vars(parser.parse_known_args(argv)[0])
    except argparse.ArgumentError:
        return None
