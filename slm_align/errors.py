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


def storage_error(exc: OSError) -> Optional[UserError]:
    """The file system refused a read or write (full disk, quota, permissions): the
    user's to fix, not a bug."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG):
        return UserError(f"cannot write{where}: {exc.strerror}; free some space or choose another "
                         "--out, then run again (finished outputs were left as they were)")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"cannot access{where}: {exc.strerror}; fix its permissions "
                         "or choose another path")
    return None
