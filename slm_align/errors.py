"""User errors versus bugs.

A :class:`UserError` is bad input the user can fix: the CLI prints its one-line message and exits
with code 2. Anything else is a bug and keeps its traceback.
"""

import errno
from typing import Optional

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: one line that names the problem and the fix."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
