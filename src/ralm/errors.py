"""Errors caused by the user's input. The CLI prints them as one line with exit code 2;
the server turns them into a 4xx. Anything else is a bug and keeps its traceback.
Warnings about input that was accepted but looks wrong are printed as one `warning:` line."""


class RalmError(Exception):
    """Bad input or usage: the message names the file:line, option or value at fault."""


class RalmWarning(UserWarning):
    """Input accepted but suspicious (records skipped, results that suggest the wrong file)."""


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """"1 document", "2 documents", "1,024 blocks": counts in messages, right in the singular
    (`nouns`: an irregular plural)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def first_line(error: BaseException) -> str:
    """A library exception's message in one line for a RalmError: its first line, or its type's
    name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
