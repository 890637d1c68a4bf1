"""Property-based tests (hypothesis): the readers of everything a user or a client hands ralm
either give a correct result or a clear error (RalmError, a 4xx), never another exception.
Bounded to seconds each: few examples, no deadline (2 CPU cores are shared)."""

from __future__ import annotations

import json
import shutil
import string
import unicodedata

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import DOCS
from ralm.data.corpus import id_problem, read_corpus
from ralm.data.qa import read_questions
from ralm.errors import RalmError
from ralm.retrieval.search.update_log import Entry, UpdateLog, fold

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# JSON values as a hostile user writes them: any text (control characters, surrogates,
# zero-width spaces), huge and negative numbers, nesting.
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["", " ", "\u200b", "a\nb", "a\x00b", "\ud800", "Paris", "the a of", "9" * 30])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
# Mostly well-formed records with hostile values, some with wrong types or fields, and garbage.
DOC = st.fixed_dictionaries({"id": TEXT | st.integers(), "text": TEXT}, optional={"title": TEXT})
QUESTION = st.fixed_dictionaries({"question": TEXT, "answers": st.lists(TEXT, max_size=3) | TEXT}, optional={"id": TEXT})
RECORD = st.fixed_dictionaries({}, optional={"id": JSON, "title": JSON, "text": JSON, "question": JSON, "answers": JSON})
GARBAGE = JSON.map(json.dumps) | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
LINE = (DOC | QUESTION | RECORD).map(json.dumps) | GARBAGE


def _write(tmp_path, name, lines) -> object:
    path = tmp_path / name
    path.write_bytes(b"".join(line.encode("utf-8", "surrogatepass") + b"\n" for line in lines))
    return path


def _clean_documents_or_a_clear_error(path) -> None:
    try:
        docs = list(read_corpus(path))
    except RalmError as e:
        assert str(e)
        return
    for d in docs:  # every document can be written, indexed and addressed
        for value in (d.id, d.title, d.text):
            value.encode("utf-8")
        assert d.text.strip() and d.id.strip() and not any(unicodedata.category(c) == "Cc" for c in d.id)


@FUZZ
@given(lines=st.lists(DOC.map(json.dumps) | LINE, max_size=6))
def test_the_corpus_reader_gives_clean_documents_or_a_clear_error(tmp_path_factory, lines):
    _clean_documents_or_a_clear_error(_write(tmp_path_factory.mktemp("c"), "c.jsonl", lines))


@FUZZ
@given(lines=st.lists(QUESTION.map(json.dumps) | LINE, max_size=6))
def test_the_question_reader_gives_questions_or_a_clear_error(tmp_path_factory, lines):
    path = _write(tmp_path_factory.mktemp("q"), "q.jsonl", lines)
    try:
        qs = read_questions(path)
    except RalmError as e:
        assert str(e)
        return
    for q in qs:  # every question can be printed and written to a predictions file
        assert q.question.strip() and all(isinstance(a, str) for a in q.answers)
        json.dumps([q.question, *q.answers], ensure_ascii=False).encode("utf-8")


# TSV fields as hostile files hold them: quotes, bare CRs, tabs, over csv's 131,072-character limit.
FIELD = TEXT | st.sampled_from(['"quoted"', 'a"b', '""', "a\rb", "x" * 131_073, '"' + "y" * 131_073 + '"', "\r"])


@FUZZ
@given(rows=st.lists(st.lists(FIELD, min_size=2, max_size=4), max_size=4))
@example(rows=[["a", "x" * 131_073, "t"], ["b", "one\rtwo", "t"]])
def test_the_tsv_reader_gives_clean_documents_or_a_clear_error(tmp_path_factory, rows):
    lines = ["id\ttext\ttitle"] + ["\t".join(r) for r in rows]
    _clean_documents_or_a_clear_error(_write(tmp_path_factory.mktemp("t"), "c.tsv", lines))


@FUZZ
@given(name=TEXT.filter(lambda n: "/" not in n and "\x00" not in n and n not in ("", ".", "..")))
@example(name="a\nb")
@example(name=".notes")  # hidden: the empty corpus's error says how to read it
def test_txt_file_names_become_valid_ids_or_a_clear_error(tmp_path_factory, name):
    folder = tmp_path_factory.mktemp("txt")
    try:
        (folder / f"{name}.txt").write_text("some text")
    except (OSError, UnicodeEncodeError):  # a name this filesystem cannot hold
        return
    try:
        docs = list(read_corpus(folder))
    except RalmError as e:
        assert "rename the file" in str(e)
        return
    assert [d.id for d in docs] == [f"{name}.txt"] and id_problem(docs[0].id) is None


@pytest.fixture(scope="module")
def retriever_dir(tmp_path_factory, tiny_bert):
    from ralm.retrieval.towers.encoders import Retriever

    path = tmp_path_factory.mktemp("retriever") / "r"
    Retriever.from_pretrained(str(tiny_bert), dim=16).save_pretrained(path)
    return path


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(["dim", "pooling", "normalize", "encoder", "query_max_len", "score_scale",
                                                 "projection_ready", "pair_sep_id", "bogus"]), JSON, max_size=3),
       encoder=st.dictionaries(st.sampled_from(["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                                                "model_type", "intermediate_size"]), JSON, max_size=2))
@example(changes={"encoder": 5}, encoder={})
@example(changes={}, encoder={"num_attention_heads": 0})
def test_a_garbage_retriever_config_loads_or_is_a_clear_error(tmp_path_factory, retriever_dir, changes, encoder):
    from ralm.retrieval.towers.encoders import Retriever

    folder = tmp_path_factory.mktemp("r")
    for f in retriever_dir.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((retriever_dir / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, **changes, "encoder": {**config["encoder"], **encoder}}
                                                   if isinstance(changes.get("encoder", {}), dict) else {**config, **changes}))
    try:
        Retriever.from_pretrained(folder)
    except RalmError as e:
        assert str(e)


IDS = st.sampled_from(["a", "b", "c", "é", "a b", "x/y"])
OPS = st.lists(st.one_of(st.tuples(st.just("add"), IDS, st.text(string.printable, min_size=1, max_size=8)),
                         st.tuples(st.just("delete"), IDS, st.just(""))), max_size=12)


def _model(ops):
    """What a replay must give: the last add of each id (in the order of those adds), and the
    ids deleted since their last add."""
    adds, deleted = {}, set()
    for op, i, text in ops:
        adds.pop(i, None)
        if op == "add":
            adds[i] = text
            deleted.discard(i)
        else:
            deleted.add(i)
    return list(adds.items()), deleted


def _append(log: UpdateLog, records: list[dict]) -> None:
    """As a writer does, under the lock it would hold: after the log's last whole batch."""
    read = log.read()
    log_id = read.id or log.rewrite([])
    log.append([Entry(r) for r in records], log_id=log_id, at=log.read().end)


@FUZZ
@given(ops=OPS, torn=st.binary(max_size=20).filter(lambda b: b"\n" not in b), batch=st.integers(1, 3))
def test_update_log_replay_matches_the_operations_and_ignores_a_torn_tail(tmp_path_factory, ops, torn, batch):
    root = tmp_path_factory.mktemp("log")
    log = UpdateLog(root)
    records = [{"op": "add", "id": i, "title": "", "text": text} if op == "add" else {"op": "delete", "id": i} for op, i, text in ops]
    for at in range(0, len(records), batch):
        _append(log, records[at:at + batch])
    with open(log.path, "ab") as f:
        f.write(torn)  # a crash mid-append: never acknowledged
    before = log.path.read_bytes()
    added, deleted = fold(log.read().records)
    assert ([(r["id"], r["text"]) for r in added], deleted) == _model(ops)
    assert log.path.read_bytes() == before  # a reader never modifies the log
    _append(log, [{"op": "delete", "id": "zz"}])  # the next writer cuts the torn tail first
    assert fold(log.read().records) == (added, deleted | {"zz"})


@FUZZ
@given(garbage=LINE)
def test_update_log_with_a_foreign_line_is_a_clear_error_or_replays(tmp_path_factory, garbage):
    root = tmp_path_factory.mktemp("log")
    log = UpdateLog(root)
    _append(log, [{"op": "add", "id": "a", "title": "", "text": "x"}])
    with open(log.path, "ab") as f:
        f.write(garbage.encode("utf-8", "surrogatepass") + b"\n")
    try:
        added, _ = fold(log.read().records)
    except RalmError as e:
        assert "updates.jsonl:3" in str(e)  # after the header and the first record
        return
    assert all(isinstance(d["id"], str) and isinstance(d["text"], str) for d in added)  # a valid record may replace or delete "a"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from ralm.retrieval.index.build import build_index
    from ralm.serve.app import create_app
    from ralm.serve.service import ServeConfig, Service

    root = tmp_path_factory.mktemp("http")
    build_index(DOCS, root / "bm25", kind="bm25", show_progress=False)
    with TestClient(create_app(Service(ServeConfig(index=str(root / "bm25"), api_key="k")), start_watcher=False),
                    base_url="http://127.0.0.1") as client:
        yield client
    shutil.rmtree(root, ignore_errors=True)


BODY = (JSON | RECORD | st.fixed_dictionaries({"documents": st.lists(RECORD, max_size=3)}) |
        st.fixed_dictionaries({"query": TEXT, "k": JSON})).map(lambda v: json.dumps(v).encode()) | st.binary(max_size=60)


@FUZZ
@given(path=st.sampled_from(["/search", "/documents", "/ask"]), body=BODY)
def test_any_http_body_gets_an_answer_or_a_4xx_with_a_reason(http, path, body):
    r = http.post(path, content=body, headers={"Content-Type": "application/json", "X-API-Key": "k"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]


@FUZZ
@given(key=st.binary(min_size=1, max_size=12).filter(lambda b: not set(b) & set(b"\r\n\x00")))
def test_any_api_key_header_is_401_or_accepted(http, key):
    r = http.post("/documents", json={"documents": [{"id": "k", "text": "key test"}]}, headers={"X-API-Key": key})
    assert r.status_code == (200 if key == b"k" else 401), r.text


@FUZZ
@given(doc_id=TEXT)
@example(doc_id=" padded ")
@example(doc_id="..")
@example(doc_id="a/b c?d#e%f")
def test_every_id_the_server_accepts_can_be_deleted_by_url(http, doc_id):
    from urllib.parse import quote

    added = http.post("/documents", content=json.dumps({"documents": [{"id": doc_id, "text": "round trip"}]}),
                      headers={"Content-Type": "application/json", "X-API-Key": "k"})
    assert added.status_code in (200, 422), added.text
    url = f"/documents/{quote(doc_id.encode('utf-8', 'surrogatepass'), safe='')}"
    r = http.delete(url, headers={"X-API-Key": "k"})
    if added.status_code == 200:
        assert r.status_code == 200 and r.json()["deleted"] == added.json()["added"][0], r.text
    else:
        assert 400 <= r.status_code < 500 and r.json()["error"]
