"""Question files, the length a question may have (MAX_QUESTION_CHARS) and SQuAD answer
normalisation.

A question file is JSON Lines: {"id", "question", "answers": [...]} (other keys kept in
`extra`, e.g. "doc_id" for analysis; never used at prediction time).
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from ralm import defaults
from ralm.data.corpus import check_unicode, decode_line, iter_jsonl
from ralm.errors import RalmError


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]
    extra: dict = field(default_factory=dict, compare=False)


def too_long(where: str, chars: int | None = None) -> RalmError:
    """The error of a question or search query over MAX_QUESTION_CHARS (src/ralm/defaults.py, the
    server's limit too), naming `where` it was read: `chars` characters, or more than the limit
    when a bounded read stopped before the end."""
    limit = defaults.MAX_QUESTION_CHARS
    held = f"{chars:,}" if chars is not None else f"more than {limit:,}"
    return RalmError(f"{where} holds {held} characters; a question or search query holds at most {limit:,}")


def check_length(text: str, where: str) -> str:
    """`text`, a question or a search query, refused when it is longer than MAX_QUESTION_CHARS or
    is not Unicode text: bytes of argv that are not UTF-8 arrive as lone surrogates (Python's
    surrogateescape), which no tokenizer takes."""
    if len(text) > defaults.MAX_QUESTION_CHARS:
        raise too_long(where, len(text))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
        raise RalmError(f"{where} is not UTF-8 text ({what} at character {e.start}); the terminal or "
                        "script sent another encoding: give it as UTF-8") from None
    return text


def read_question_line(stream: BinaryIO, where: str, lineno: int) -> str | None:
    """Line `lineno` of a byte stream of questions (stdin), without its line break; None at the
    end. At most the bytes of MAX_QUESTION_CHARS characters (4 each in UTF-8) and a line break are
    read, so a longer line, an endless one too (`< /dev/zero`), is refused naming where:N after a
    few kilobytes, never read into memory; so is a line that is not UTF-8."""
    cap = 4 * defaults.MAX_QUESTION_CHARS + 2  # + "\r\n"
    raw = stream.readline(cap)
    if not raw:
        return None
    if len(raw) == cap and not raw.endswith(b"\n"):
        raise too_long(f"{where}:{lineno}: the line")
    line = decode_line(raw, where, lineno).rstrip("\r\n")
    return check_length(line, f"{where}:{lineno}: the line")


def read_questions(path: str | os.PathLike) -> list[Question]:
    return list(iter_questions(path))


def iter_questions(path: str | os.PathLike) -> Iterator[Question]:
    path = Path(path)
    if not path.is_file():
        raise RalmError(f"question file not found: {path}" if not path.exists() else f"{path}: not a regular file")
    count = 0
    for lineno, obj in iter_jsonl(path):
        if not isinstance(obj, dict):
            raise RalmError(f"{path}:{lineno}: expected a JSON object with 'question' and 'answers'")
        for key in ("question", "answers"):
            if key not in obj:
                raise RalmError(f"{path}:{lineno}: missing field '{key}'")
        answers = obj["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(obj["question"], str) or not obj["question"].strip():
            raise RalmError(f"{path}:{lineno}: field 'question' must be a non-empty string")
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise RalmError(f"{path}:{lineno}: field 'answers' must be a list of strings")
        # the question as it is read: SQuAD v1.1's train file pads one with 25,592 spaces
        check_length(obj["question"].strip(), f"{path}:{lineno}: field 'question'")
        for key, value in (("question", obj["question"]), *(("answers", a) for a in answers)):
            check_unicode(value, f"{path}:{lineno}", key)
        extra = {k: v for k, v in obj.items() if k not in ("id", "question", "answers")}
        count += 1
        yield Question(str(obj.get("id", f"{path.stem}-{lineno}")), obj["question"].strip(), tuple(answers), extra)
    if count == 0:
        raise RalmError(f"{path}: no questions in the file")


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1's normalisation: lower case, drop punctuation and articles, squash spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def has_answer(text: str, answers: tuple[str, ...] | list[str]) -> bool:
    """True when a normalised answer occurs in the normalised text on word boundaries."""
    norm = f" {normalize_answer(text)} "
    return any(a for a in (normalize_answer(x) for x in answers) if a and f" {a} " in norm)


# Words a question is made of that no passage need repeat for it to answer: question words,
# auxiliaries, pronouns, prepositions, articles.
_FUNCTION_WORDS = frozenset("""a an the of in on at to for from by with about into as and or is are was were be been being
do does did has have had what which who whom whose when where why how many much is it its this that these those there
their they he she his her him them we you your our i my me can could will would should may might shall than then
not no if so one ones""".split())
_WORD = re.compile(r"\w+")


def question_coverage(question: str, text: str) -> float:
    """The share of the question's content words (not `_FUNCTION_WORDS`) that occur in `text`,
    compared lower-cased; 1.0 for a question without any. A measure that means the same on any
    corpus: "How many desks does the Lisbon office have?" read in Bergen's section covers less."""
    words = {w for w in _WORD.findall(question.lower()) if w not in _FUNCTION_WORDS}
    if not words:
        return 1.0
    seen = set(_WORD.findall(text.lower()))
    return sum(w in seen for w in words) / len(words)


def question_names(question: str) -> set[str]:
    """The question's names, lower-cased: its words written capitalised after the first (a
    question's first word is capitalised whatever it is), or holding a digit or an underscore
    (versions, codes, setting names); not its function words. "When did the Lisbon office open?"
    -> {"lisbon"}; a question typed all in lower case has none."""
    words = _WORD.findall(question)
    return {w.lower() for i, w in enumerate(words)
            if ((i > 0 and w[0].isupper()) or any(c.isdigit() or c == "_" for c in w)) and w.lower() not in _FUNCTION_WORDS}


def name_coverage(question: str, text: str) -> float:
    """The share of the question's names (`question_names`) that occur in `text`; 1.0 for a
    question without any. An answer read in a sibling's record ("Bruno Hollis" asked, "Jamal
    Hollis" read) covers fewer of the names than of the question's words (`question_coverage`)."""
    names = question_names(question)
    if not names:
        return 1.0
    seen = set(_WORD.findall(text.lower()))
    return sum(n in seen for n in names) / len(names)
