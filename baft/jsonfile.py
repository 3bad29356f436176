"""Versioned JSON files: atomic writes, and reads that fail with one line naming the file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from pathlib import Path

import jsonschema

from baft.errors import ConfigError


def write_json_atomic(path, doc, indent: int | None = 1) -> Path:
    """Write ``doc`` to ``path`` so that a reader sees the old file or the new one, never half."""
    return write_text_atomic(path, json.dumps(doc, indent=indent))  # dumps: json.dump writes piece by piece


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` (JSON already serialized) and a newline to ``path``, atomically as :func:`write_json_atomic`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def append_line(path, doc: dict, sync: bool = False) -> None:
    """Append ``doc`` to the JSON-lines file ``path``, on a line of its own also where the file's last line was cut
    short (a process killed as it wrote, a full disk): appended to it, the two made one line no reader could parse
    (a finished ``baft train`` ended in that error, and ``baft report`` refused the run). ``sync``: on disk before it
    returns."""
    with open(path, "ab+") as f:
        torn = f.seek(0, os.SEEK_END) > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(doc).encode() + b"\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())


@lru_cache(maxsize=None)
def _schema(name: str) -> dict:
    return json.loads(resources.files("baft.schemas").joinpath(name).read_text())


def read_bytes(path, expected: str = "a JSON file") -> bytes:
    """The bytes of a file, every way it can be unreadable a one-line ConfigError naming it."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected {expected}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None


def read_json(path) -> dict:
    """Parse a JSON file, turning every way it can be unreadable into a one-line ConfigError."""
    return parse_object(read_bytes(path).decode(errors="replace"), str(Path(path)))


def parse_object(text: str, where: str) -> dict:
    """A JSON object from ``text``; a one-line ConfigError naming ``where`` (file, or file:line) otherwise."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    return doc


def load_versioned(path, schema: str, version: int, schema_file: str,
                   upgrade: Callable[[dict], dict] | None = None) -> dict:
    """Read a baft JSON document, check its kind and version, and validate it against its schema.

    ``upgrade`` turns a document of the previous version (``version - 1``) into one of ``version``; older
    documents are refused, and the previous version's too where there is no ``upgrade``.
    """
    doc = read_json(path)
    kind = doc.get("schema")
    if kind != schema:
        raise ConfigError(f"{path}: not a {schema} file (its 'schema' is {kind!r})")
    found = doc.get("version")
    if not isinstance(found, int):
        raise ConfigError(f"{path}: missing integer 'version'")
    if found > version:
        raise ConfigError(f"{path}: {schema} version {found} is newer than this baft reads ({version}); upgrade baft")
    if found == version - 1 and upgrade is not None:
        doc = {**upgrade(doc), "version": version}
    elif found < version:
        raise ConfigError(f"{path}: {schema} version {found} is older than this baft reads ({version}); profile again")
    try:
        jsonschema.validate(doc, _schema(schema_file))
    except jsonschema.ValidationError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "top level"
        raise ConfigError(f"{path}: {where}: {err.message}") from None
    return doc


def renamed(value, names: dict):
    """``value`` with every field, at any depth, whose name is a key of ``names`` renamed to its value (order kept)."""
    if isinstance(value, dict):
        return {names.get(k, k): renamed(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v, names) for v in value]
    return value
