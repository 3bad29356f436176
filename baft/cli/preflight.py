"""What ``baft train`` checks of a script's launch before it starts a manager or a rank.

A mistake found here is one line naming the file or key; found on the ranks, it would be every
rank's traceback, and a launch that starts managers and ranks only to stop them.
"""

from __future__ import annotations

from baft.config import parse_config
from baft.errors import ConfigError
from baft.jsonfile import read_bytes, read_json

CONFIG_FLAGS = ("--deepspeed_config", "--config")


def check_script_launch(command: list[str]) -> None:
    """Refuse a launch command (``SCRIPT ARGS...``) whose script cannot be read, or whose DeepSpeed config,
    named among its arguments, cannot be read or has a ``"baft"`` section the ranks would refuse."""
    if command[0].startswith("-"):  # torchrun's own options (-m module): no script file to check
        return
    check_readable(command[0])
    for path in config_files(command[1:]):
        check_baft_section(path)


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


def check_baft_section(path: str) -> None:
    """A ConfigError naming ``path`` unless it is a JSON file whose ``"baft"`` section (if any) is valid."""
    doc = read_json(path)  # names the file when it cannot be read or parsed
    try:
        parse_config(doc)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
