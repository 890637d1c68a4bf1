"""Errors caused by the user's input. The CLI prints them as one line with exit code 2;
the server turns them into a 4xx. Anything else is a bug and keeps its traceback.
Warnings about input that was accepted but looks wrong are printed as one `warning:` line."""


class RalmError(Exception):
    """Bad input or usage: the message names the file:line, option or value at fault."""


class RalmWarning(UserWarning):
    """Input accepted but suspicious (records skipped, results that suggest the wrong file)."""
