"""One exception type for every user-facing configuration or input error."""


class SPConfigError(ValueError):
    """A setting or input the user gave is invalid; the message names it and what is valid."""
