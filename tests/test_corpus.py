import json
import re

import pytest

from ralm.data.corpus import corpus_fingerprint, read_corpus
from ralm.errors import RalmError, RalmWarning


def test_jsonl_tsv_and_txt_folder_read_the_same_documents(tmp_path):
    docs = [{"id": "a", "title": "Alpha", "text": "First text."}, {"id": "b", "title": "Beta", "text": "Second text."}]
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps(d) + "\n" for d in docs) + "\n")  # a blank line is skipped
    tsv = tmp_path / "c.tsv"
    tsv.write_text("id\ttext\ttitle\n" + "".join(f"{d['id']}\t{d['text']}\t{d['title']}\n" for d in docs))
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "Alpha.txt").write_text("First text.\n")
    (folder / "Beta.txt").write_text("Second text.")
    assert [(d.id, d.title, d.text) for d in read_corpus(jl)] == [("a", "Alpha", "First text."), ("b", "Beta", "Second text.")]
    assert [(d.id, d.title, d.text) for d in read_corpus(tsv)] == [("a", "Alpha", "First text."), ("b", "Beta", "Second text.")]
    assert [(d.id, d.title, d.text) for d in read_corpus(folder)] == [("Alpha.txt", "Alpha", "First text."), ("Beta.txt", "Beta", "Second text.")]


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "c.jsonl:2: malformed JSON"),
        (b'{"id": "a", "title": "t"}\n', "c.jsonl:1: missing field 'text'"),
        (b'{"id": "a", "text": 3}\n', "c.jsonl:1: field 'text' must be a string"),
        (b'[1, 2]\n', "c.jsonl:1: expected a JSON object"),
        (b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n', "c.jsonl:2: not valid UTF-8"),
        (b"\n\n", "the corpus is empty"),
        (b'{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', None),  # duplicates are found when blocking
    ],
)
def test_bad_corpus_lines_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "c.jsonl"
    path.write_bytes(content)
    if message is None:
        assert len(list(read_corpus(path))) == 2
        return
    with pytest.raises(RalmError, match=message):
        list(read_corpus(path))


def test_missing_corpus_and_unknown_format(tmp_path):
    with pytest.raises(RalmError, match="corpus not found"):
        list(read_corpus(tmp_path / "nope.jsonl"))
    (tmp_path / "c.csv").write_text("x")
    with pytest.raises(RalmError, match="unknown corpus format"):
        list(read_corpus(tmp_path / "c.csv"))


def test_tsv_needs_id_and_text_columns(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("title\tbody\nA\tb\n")
    with pytest.raises(RalmError, match=r"c.tsv:1: TSV header"):
        list(read_corpus(path))


def test_fingerprint_changes_with_content(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n')
    before = corpus_fingerprint(path)
    path.write_text('{"id": "a", "text": "y"}\n')
    assert corpus_fingerprint(path) != before


def test_documents_with_empty_text_are_skipped_with_one_warning_naming_the_first(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("id\ttitle\ttext\na\tA\tSome text.\nb\tB\t \nc\tC\t\nd\tD\tMore text.\n")
    with pytest.warns(RalmWarning, match=r"c.tsv: skipped 2 documents with empty text \(the first at .*c.tsv:3\)") as caught:
        assert [d.id for d in read_corpus(path)] == ["a", "d"]
    assert len(caught) == 1


def test_a_corpus_of_only_empty_texts_is_an_error(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "title": "A", "text": ""}\n')
    with pytest.raises(RalmError, match="the corpus is empty .*1 had empty text"):
        list(read_corpus(path))


def test_a_tsv_field_may_be_longer_than_the_csv_modules_limit_and_hold_a_bare_cr(tmp_path):
    long = "word " * 30_000  # 150,000 characters: over csv's 131,072
    path = tmp_path / "c.tsv"
    path.write_bytes(b"id\ttitle\ttext\n" + f"a\tA\t{long}\n".encode() + f'b\t"B"\t"{long}"\n'.encode()
                     + b"c\tC\tone\rtwo\n" + b'd\t"D"\t"three\rfour"\n')
    docs = list(read_corpus(path))
    assert [(d.id, len(d.text)) for d in docs[:2]] == [("a", len(long.strip())), ("b", len(long.strip()))]
    assert [d.text for d in docs[2:]] == ["one\rtwo", "three\rfour"]
    path.write_bytes(b'id\ttext\n"e\t"x"y"z\n')  # a quote the csv module cannot read: one error naming the line
    with pytest.raises(RalmError, match=r"c.tsv:2:"):
        list(read_corpus(path))


@pytest.mark.parametrize("name, message", [("a\nb.txt", "control character"), ("a\tb.txt", "control character"), (".txt", None)])
def test_txt_file_names_are_ids_under_the_same_rules(tmp_path, name, message):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / name).write_text("text")
    if message is None:  # a hidden file is left out, with a warning: no id to judge
        with pytest.warns(RalmWarning, match=r"skipped 1 hidden entry \(\.txt\)"):
            assert [d.id for d in read_corpus(tmp_path)] == ["ok.txt"]
        return
    with pytest.raises(RalmError, match=f"its name, a document id, .*{message}"):
        list(read_corpus(tmp_path))


def test_a_fifo_named_txt_in_a_folder_is_skipped_with_a_warning_not_waited_on(tmp_path):
    import os

    (tmp_path / "ok.txt").write_text("fine")
    os.mkfifo(tmp_path / "x.txt")
    (tmp_path / "dir.txt").mkdir()
    with pytest.warns(RalmWarning, match=r"skipped 1 entry that is not a regular file \(x.txt\)"):
        assert [d.id for d in read_corpus(tmp_path)] == ["ok.txt"]
    assert corpus_fingerprint(tmp_path)  # reads the regular files only


def test_a_section_id_names_its_file_before_its_last_hash():
    """What deleting a file's name deletes (retrieval/search/live.py): anchors hold no '#', a
    file name may (`C#.md`)."""
    from ralm.data.corpus import file_of

    assert [file_of(i) for i in ("guide.md", "guide.md#setup", "paper.pdf#page=3", "C#.md#intro", "notes.txt")] == \
        ["guide.md", "guide.md", "paper.pdf", "C#.md", "notes.txt"]
    assert file_of("#top") == "#top"  # nothing before the '#': its own file


@pytest.mark.parametrize("doc_id, named", [("report\u202eexe.txt", "U+202E"), ("a\u2066b", "U+2066"), ("a\u200bb", "U+200B"),
                                          ("\ufeffdoc", "U+FEFF"), ("co\u00adop", "U+00AD")])
def test_ids_with_bidi_controls_or_invisible_characters_are_refused(tmp_path, doc_id, named):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" + json.dumps({"id": doc_id, "text": "x"}) + "\n")
    with pytest.raises(RalmError, match=rf"c\.jsonl:2: field 'id' holds an invisible character \({re.escape(named)}"):
        list(read_corpus(path))


def test_ids_keep_the_joiners_scripts_and_emoji_need(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "text": "x"}) + "\n"
                    + json.dumps({"id": "\U0001f468\u200d\U0001f469", "text": "y"}) + "\n")
    assert len(list(read_corpus(path))) == 2


@pytest.mark.parametrize("suffix", [".txt", ".md", ".html", ".htm"])
def test_a_binary_file_is_refused_whatever_its_text_suffix(tmp_path, suffix):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / f"blob{suffix}").write_bytes(b"<p>" + bytes(range(256)) * 4)
    with pytest.raises(RalmError, match=rf"blob\{suffix}(:1)?: .*(binary file|not valid UTF-8)"):
        list(read_corpus(tmp_path))
    (tmp_path / f"blob{suffix}").write_bytes(b"ok\x00" if suffix == ".txt" else b"<p>ok</p>\x00")  # valid UTF-8, still binary
    with pytest.raises(RalmError, match=rf"blob\{suffix}: a binary file, not text \(a NUL byte at offset"):
        list(read_corpus(tmp_path))


def test_a_utf16_html_page_with_its_byte_order_mark_is_read(tmp_path):
    (tmp_path / "page.html").write_bytes("<html><body><main><p>A page in UTF-16.</p></main></body></html>".encode("utf-16"))
    assert "UTF-16" in " ".join(d.text for d in read_corpus(tmp_path))
