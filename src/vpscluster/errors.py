"""Errors a user can act on.

A `UserError` is printed by the CLI as one line on stderr (no traceback) and gives a
non-zero exit status. Its message names the problem *and* the fix, e.g.
"cluster.yaml: nodes[2].port: 70000 is not a port (1-65535)".
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line.

    The line is guaranteed: a message that quotes user text holding line breaks (a file name, a
    value) has them replaced by spaces, so no input can split the error over several lines.
    """

    exit_code = 2

    def __init__(self, *args: object) -> None:
        super().__init__(*(" ".join(a.splitlines()) if isinstance(a, str) else a for a in args))


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


async def unless_interrupted(aw, interrupted, before: str = "anything was started"):
    """Await `aw` unless the asyncio.Event `interrupted` is set first: then the work is cancelled
    and `Interrupted("interrupted before <before>")` is raised."""
    import asyncio

    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(interrupted.wait())
    done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stop.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Interrupted(f"interrupted before {before}")


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (just the type when the message is empty)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
