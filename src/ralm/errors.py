"""Errors caused by the user's input. The CLI prints them as one line with exit code 2;
the server turns them into a 4xx. Anything else is a bug and keeps its traceback."""


class RalmError(Exception):
    """Bad input or usage: the message names the file:line, option or value at fault."""
