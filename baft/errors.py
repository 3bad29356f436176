"""Errors that are the user's to fix (the CLI prints them as one line, never a traceback), the words by which a
rank's error says that a peer's process is gone, and the exception a script ended with."""

import sys
from typing import Optional

# what a gloo or NCCL error says when the peer's process is gone
LOST_PEER = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited")


def says_peer_lost(message: str) -> bool:
    """Whether an error's ``message`` is that of a communication failing because a peer's process is gone."""
    return any(sign in message for sign in LOST_PEER)


def script_raised() -> Optional[BaseException]:
    """At interpreter exit: the exception the script ended with, uncaught, or None (it returned, or called
    ``sys.exit``). Set by the interpreter as it prints the traceback, and by baft's warm ranks as they do."""
    return getattr(sys, "last_value", None)


class BaftError(Exception):
    """A user-facing error. ``str(err)`` names the file or key and the problem."""


class ConfigError(BaftError):
    """A bad key or value in a baft config, bubble map or plan."""
