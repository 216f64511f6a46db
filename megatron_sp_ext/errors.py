"""The exception types for errors the user caused (a setting, an input, a file), as opposed to bugs.

Entry points print such errors as one message, without a traceback (training/video_dit/faults.py)."""


class UserError(Exception):
    """Base of the errors a user causes and can fix; the message names the setting or file and what is valid."""


class SPConfigError(UserError, ValueError):
    """A setting or input the user gave is invalid; the message names it and what is valid."""
