"""User-facing errors.

Anything the user can fix (a bad flag, a malformed scenario, a missing file) raises
:class:`ShoalError` with a one-line message that says what is wrong and how to fix it.
The CLI prints such errors as ``error: <message>`` and exits with status 2, without a
traceback. Every other exception is a bug and keeps its traceback.
"""


class ShoalError(Exception):
    """An error caused by user input; its message is shown to the user as one line."""
