import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from ralm.data.blocks import BlockConfig, BlockStore, build_block_store, iter_blocks, join_query_evidence, wordpiece_tokenizer
from ralm.data.corpus import Document
from ralm.encoders.loading import default_model_path
from ralm.errors import RalmError, RalmWarning


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


LONG = " ".join(f"Sentence number {i} talks about the river {i} and its {i % 7} bridges." for i in range(120))


@pytest.mark.parametrize("max_len", [40, 288])
def test_blocking_keeps_every_body_token_once_and_respects_max_len(tokenizer, max_len):
    doc = Document("long", "A fairly long title about rivers", LONG)
    [(_, blocks)] = list(iter_blocks([doc], tokenizer, BlockConfig(max_len=max_len)))
    assert len(blocks) > 1
    body = wordpiece_tokenizer(tokenizer).encode(LONG, add_special_tokens=False).ids
    joined = [t for b in blocks for t in b.token_ids[b.body_start : -1]]
    assert joined == body  # every wordpiece exactly once, in order
    for b in blocks:
        assert len(b.token_ids) <= max_len
        assert b.token_ids[0] == tokenizer.cls_token_id and b.token_ids[-1] == tokenizer.sep_token_id
        assert b.token_ids[b.body_start - 1] == tokenizer.sep_token_id
    assert [b.id for b in blocks] == [f"long:{j}" for j in range(len(blocks))]


def test_blocks_end_on_sentence_boundaries(tokenizer):
    doc = Document("d", "T", LONG)
    [(_, blocks)] = list(iter_blocks([doc], tokenizer, BlockConfig(max_len=64)))
    for b in blocks:
        assert LONG[b.char_span[0]:b.char_span[1]].endswith("bridges.")


def test_a_sentence_longer_than_a_block_is_cut_between_wordpieces(tokenizer):
    text = "word " * 500 + "end."
    [(_, blocks)] = list(iter_blocks([Document("d", "", text)], tokenizer, BlockConfig(max_len=64)))
    body = wordpiece_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids
    assert [t for b in blocks for t in b.token_ids[b.body_start:-1]] == body
    assert max(len(b.token_ids) for b in blocks) == 64


def test_block_store_round_trip_is_memory_mapped(tmp_path, tokenizer):
    corpus = tmp_path / "c.jsonl"
    docs = [{"id": "a", "title": "Alpha", "text": LONG}, {"id": "b", "title": "Beta", "text": "Short text here."}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    store = build_block_store(corpus, tmp_path / "blocks", tokenizer, cfg=BlockConfig(max_len=100), show_progress=False)
    assert isinstance(store.tokens.values, np.memmap)
    assert store.manifest["documents"] == 2 and len(store) > 2
    last = store.record(len(store) - 1)
    assert last == {"id": "b:0", "doc_id": "b", "title": "Beta", "text": "Short text here."}
    assert int(store.doc_index[len(store) - 1]) == 1 and int(store.doc_index[0]) == 0
    assert tokenizer.decode(store.body(len(store) - 1)) == "short text here."
    texts = " ".join(store.record(i)["text"] for i in range(len(store) - 1))
    assert texts.split() == LONG.split()


def test_duplicate_document_ids_are_rejected(tmp_path, tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "x", "text": "one"}\n{"id": "y", "text": "two"}\n{"id": "x", "text": "three"}\n')
    with pytest.raises(RalmError, match="'x' appears more than once"):
        build_block_store(corpus, tmp_path / "blocks", tokenizer, show_progress=False)
    assert not (tmp_path / "blocks").exists()  # nothing half-built is left under the name


def test_join_query_evidence_layout():
    ids, types, start = join_query_evidence([5, 6, 7], np.array([8, 9, 10, 11]), cls_id=101, sep_id=102, max_len=9)
    assert ids == [101, 5, 6, 7, 102, 8, 9, 10, 102]
    assert types == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert start == 5 and ids[start] == 8


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage, named", [
    (lambda d: _truncate(d / "tokens" / "values.bin", 10), "values.bin"),
    (lambda d: _truncate(d / "tokens" / "offsets.npy", 40), "offsets.npy"),
    (lambda d: _truncate(d / "body_start.npy", 0), "body_start.npy"),
    (lambda d: (d / "manifest.json").write_text("{garbage"), "manifest.json"),
    (lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe"), "manifest.json"),
    (lambda d: _truncate(d / "blocks.jsonl", 30), "blocks.jsonl"),
    (lambda d: np.save(d / "doc_index.npy", np.zeros(1, np.int64)), "doc_index.npy"),
])
def test_a_damaged_block_store_is_an_error_naming_the_file(tmp_path, tokenizer, damage, named):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "One text."}\n{"id": "b", "text": "Another text."}\n')
    build_block_store(corpus, tmp_path / "blocks", tokenizer, show_progress=False).close()
    damage(tmp_path / "blocks")
    with pytest.raises(RalmError, match=rf"{named} is damaged.*rebuild"):
        BlockStore(tmp_path / "blocks")


def test_a_block_record_overwritten_in_place_is_an_error_naming_blocks_jsonl(tmp_path, tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "One text."}\n{"id": "b", "text": "Another text."}\n')
    build_block_store(corpus, tmp_path / "blocks", tokenizer, show_progress=False).close()
    meta = tmp_path / "blocks" / "blocks.jsonl"
    meta.write_bytes(b"#" * meta.stat().st_size)  # same size: only reading the record finds it
    store = BlockStore(tmp_path / "blocks")
    with pytest.raises(RalmError, match=r"blocks.jsonl is damaged \(block 1 "):
        store.record(1)


def test_documents_with_empty_text_are_skipped_with_a_warning(tmp_path, tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "One text."}\n{"id": "e", "title": "Empty", "text": " "}\n{"id": "b", "text": "Two."}\n')
    with pytest.warns(RalmWarning, match=r"skipped 1 document with empty text \(the first at .*c.jsonl:2\)"):
        store = build_block_store(corpus, tmp_path / "blocks", tokenizer, show_progress=False)
    assert [store.record(i)["doc_id"] for i in range(len(store))] == ["a", "b"]  # no title-only block


def test_document_rows_find_a_documents_blocks_reading_one_record(tmp_path, tokenizer):
    """doc id -> its consecutive block rows, from doc_hash.npy: one record read per lookup (the
    id is confirmed), not one per document; a store written before doc_hash.npy answers alike."""
    docs = [{"id": f"doc{i}", "title": f"T{i}", "text": "Short sentence here. " * (1 + 40 * (i % 3))} for i in range(30)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    store = build_block_store(corpus, tmp_path / "blocks", tokenizer, cfg=BlockConfig(max_len=100), show_progress=False)
    truth: dict[str, list[int]] = {}
    for row in range(len(store)):
        truth.setdefault(store.record(row)["doc_id"], []).append(row)
    assert max(len(r) for r in truth.values()) > 1  # documents of several blocks
    reads = []
    record = store.record
    store.record = lambda i: reads.append(i) or record(i)
    rows = store.document_rows()
    for d in docs:
        reads.clear()
        assert list(rows.get(d["id"])) == truth[d["id"]] and len(reads) == 1
    assert rows.get("no such document") is None and "doc3" in rows and "doc" not in rows
    reads.clear()
    assert list(rows) == [d["id"] for d in docs] == list(rows) and len(reads) == len(docs)  # every id, read once
    (tmp_path / "blocks" / "doc_hash.npy").unlink()
    old = BlockStore(tmp_path / "blocks").document_rows()
    assert all(list(old.get(d["id"])) == truth[d["id"]] for d in docs) and old.get("doc") is None
    assert list(old) == [d["id"] for d in docs]


def test_a_files_documents_are_found_by_the_hash_of_its_name_reading_only_their_records(tmp_path, tokenizer):
    """file name -> its documents (its own id's, its sections' and pages'), from file_hash.npy:
    one record read per document of the file, none of the others'; a store written before
    file_hash.npy answers alike, and a compacted store keeps the hashes."""
    from ralm.data.blocks import compact_block_store

    ids = ["guide.md", "guide.md#setup", "other.md#setup", "guide.mdx", "paper.pdf#page=1", "paper.pdf#page=2", "C#.md",
           "C#.md#intro", "guide.md#faq"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": f"Text of {i}."}) + "\n" for i in ids))
    store = build_block_store(corpus, tmp_path / "blocks", tokenizer, show_progress=False)
    want = {"guide.md": ["guide.md", "guide.md#setup", "guide.md#faq"], "paper.pdf": ["paper.pdf#page=1", "paper.pdf#page=2"],
            "C#.md": ["C#.md#intro"], "C": ["C#.md"], "guide.md#setup": [], "guide": [], "nowhere.md": []}
    reads = []
    record = store.record
    store.record = lambda i: reads.append(i) or record(i)
    rows = store.document_rows()
    for name, found in want.items():
        reads.clear()
        assert rows.of_file(name) == found and len(reads) == len(found), name
    (tmp_path / "blocks" / "file_hash.npy").unlink()
    old = BlockStore(tmp_path / "blocks").document_rows()
    assert {name: old.of_file(name) for name in want} == want
    keep = np.flatnonzero(~np.isin(np.arange(len(store)), [1, 4]))  # guide.md#setup and paper.pdf#page=1 gone (a block each)
    compacted = compact_block_store(store, keep, [], tmp_path / "compacted", origin={})
    assert (tmp_path / "compacted" / "file_hash.npy").is_file()
    assert compacted.document_rows().of_file("guide.md") == ["guide.md", "guide.md#faq"]
    assert compacted.document_rows().of_file("paper.pdf") == ["paper.pdf#page=2"]


def test_special_tokens_typed_in_a_document_are_text(tokenizer):
    """"[SEP]" in a document is the wordpieces of "[sep]", never a second separator the towers
    would take for the end of the title; only the ids ralm places are special."""
    doc = Document("typed", "A [CLS] title", "Before [SEP] after [MASK] and [PAD].")
    [(_, [block])] = list(iter_blocks([doc], tokenizer))
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id, tokenizer.pad_token_id}
    placed = [i for i, t in enumerate(block.token_ids) if t in special]
    assert placed == [0, block.body_start - 1, len(block.token_ids) - 1]
    assert "[ sep ]" in tokenizer.decode(block.token_ids[block.body_start : -1])


def test_special_tokens_typed_in_a_query_are_text_to_the_retriever(tiny_bert):
    """The query tower reads "[SEP]" typed in a question as the block builder reads it in a
    document: its wordpieces, with only the ids ralm places special, through either tokenizer
    (the checkpoint's tokenizer.json, or transformers' for a plain model directory)."""
    from transformers import AutoTokenizer

    from ralm.retrieval.towers.encoders import Retriever

    retriever = Retriever.from_pretrained(tiny_bert, dim=None)
    for tok in (retriever.tokenizer, AutoTokenizer.from_pretrained(tiny_bert)):
        retriever.tokenizer = tok
        special = {tok.cls_token_id, tok.sep_token_id, tok.mask_token_id, tok.pad_token_id}
        ids = retriever.tokenize_queries(["who [SEP] wrote [MASK] it"])["input_ids"][0].tolist()
        assert [i for i, t in enumerate(ids) if t in special] == [0, len(ids) - 1], (type(tok).__name__, ids)
        doc = retriever.tokenize_documents([Document("d", "A [CLS] title", "body [SEP] text")])["input_ids"][0].tolist()
        assert sum(t in special for t in doc) == 3, (type(tok).__name__, doc)
