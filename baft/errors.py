"""Errors that are the user's to fix: the CLI prints them as one line, never a traceback."""


class BaftError(Exception):
    """A user-facing error. ``str(err)`` names the file or key and the problem."""


class ConfigError(BaftError):
    """A bad key or value in a baft config, bubble map or plan."""
