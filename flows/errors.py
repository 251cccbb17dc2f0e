"""The CLI's error for a mistake in what the user gave. Its own module so that both the parser (flows/cli.py) and
the commands (flows/commands.py) can import it without importing each other: cli.py loads commands.py when a
command runs, and commands.py needs only this."""


class UserError(Exception):
    """An error in what the user gave; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
