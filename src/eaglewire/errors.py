"""The errors eaglewire raises for input it refuses.

The command line reports an ``EaglewireError`` as one sentence and exits 2; any other exception,
a ValueError from inside torch included, is a bug and crashes with its traceback.
"""


class EaglewireError(ValueError):
    """Input eaglewire refuses (settings, files, models, requests), with a sentence saying what and why.

    A ValueError, so code that caught ValueError around eaglewire's checks still does."""


class ConfigError(EaglewireError):
    """An invalid setting: an option out of range, or options that contradict each other."""
