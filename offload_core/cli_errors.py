"""The command line's one error type, shared by every subcommand module."""


class UsageError(Exception):
    """Bad input: reported as ``offload-core: error: <message>`` with exit status 2."""
