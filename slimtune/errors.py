"""The one exception type for mistakes a user can make.

The CLI prints its message as a single sentence and exits non-zero; anything else that
escapes is a bug in slimtune and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix: bad config, bad data, a missing file, a plan that does not fit."""
