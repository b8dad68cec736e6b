"""The errors the sweep commands report in one line, and their exit codes."""

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class SweepError(Exception):
    """A bad sweep file or bad command-line input: one line on stderr, exit 2."""


class ServerError(Exception):
    """W&B could not be reached or refused: one line on stderr, exit 1."""
