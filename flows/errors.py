"""The CLI's error for a mistake in what the user gave, and the bad input behind a failure. Their own module so
that the parser (flows/cli.py), the commands (flows/commands.py) and the log filters (flows/trials/interrupts.py)
can import them without importing each other: cli.py loads commands.py when a command runs, and commands.py needs
only this."""


class UserError(Exception):
    """An error in what the user gave; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def input_error(e: BaseException | None) -> BaseException | None:
    """The InputError (trainer/config.py) behind `e` — itself, or the cause a stage failed with — or None."""
    from tasks.spec import InputError

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, InputError):
            return e
        e, seen = getattr(e, "cause", None) or e.__cause__, seen + 1
    return None
