"""Errors a user can act on.

A `UserError` is printed by the CLI as one line on stderr (no traceback) and gives a
non-zero exit status. Its message names the problem *and* the fix, e.g.
"cluster.yaml: nodes[2].port: 70000 is not a port (1-65535)".
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


class RemoteError(UserError):
    """A node could not be reached or a command on it failed in a way the user must fix."""

    exit_code = 1


class Interrupted(UserError):
    """The user stopped the command (Ctrl-C or SIGTERM); everything it started has been stopped.

    Library code raises this instead of letting `KeyboardInterrupt` carry the news, so callers
    handle it like any other outcome; the CLI prints "interrupted" and exits 130 (128 + SIGINT).
    """

    exit_code = 130

    def __init__(self, message: str = "interrupted") -> None:
        super().__init__(message)
