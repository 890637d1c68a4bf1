"""The reader's inputs, made from text: `[CLS] question [SEP] title [SEP] evidence [SEP]` for each
(question, block title, evidence text) — `[CLS] question [SEP] evidence [SEP]` for a reader that
does not read titles (readers of ralm <= 0.4, `read_title=False`) — or for overlapping windows of
a long passage (BERT's doc stride), the spans the reader may answer with, the spans whose text is
a gold answer, and the verifier's inputs (`featurize_verify`). Tokenising lives here, the span
scorer and its objective in models/reader.py, as Hugging Face keeps tokenisation in processors.

Answer spans lie in the body only, never in the title: the title names what the block is about
(the entity a question asks after, "Handbook › Offices › Lisbon"), the answer is what the body
states about it, and the evidence shown to a user points at a place in the body. A span never
crosses a line break or a "; ": data/formats.py writes a table row's cells, a list item and a
`key: value` line so, and a value must not run into the next cell or line ("ms 1500", "7431 TCP").

Shapes: N reader inputs, L input length, W maximum span width. A span is (start i, width w):
wordpieces i .. i+w of the input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ralm.data.blocks import BlockConfig, join_query_evidence, sentence_ends, wordpiece_tokenizer
from ralm.data.padding import pad_rows
from ralm.data.qa import normalize_answer
from ralm.errors import RalmError


@dataclass
class ReaderBatch:
    """Reader inputs for N (question, block) pairs; `offsets[n][j]` is the character span of
    evidence wordpiece j in `texts[n]` (for turning a span back into text)."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    token_type_ids: torch.Tensor  # [N, L]
    evidence_start: torch.Tensor  # [N] first evidence wordpiece
    evidence_end: torch.Tensor  # [N] one past the last evidence wordpiece (the final [SEP])
    offsets: list[list[tuple[int, int]]]
    texts: list[str]
    # [N, L] bool: a word begins at this wordpiece (not a `##` continuation); at the final [SEP]:
    # the text after the window does not continue the window's last word. None (inputs built
    # without a tokenizer, e.g. HF-REALM parity): every wordpiece is a word boundary.
    word_start: torch.Tensor | None = None
    # [N, L] int: which stretch of the text between span boundaries (`SPAN_BOUNDARY`) each
    # wordpiece lies in; a span starts and ends in one. None: no boundaries (one stretch).
    segment: torch.Tensor | None = None

    TENSORS = ("input_ids", "attention_mask", "token_type_ids", "evidence_start", "evidence_end")
    OPTIONAL = ("word_start", "segment")

    def _tensors(self, pick) -> dict:
        out = {k: pick(getattr(self, k)) for k in self.TENSORS}
        return {**out, **{k: None if getattr(self, k) is None else pick(getattr(self, k)) for k in self.OPTIONAL}}

    def to(self, device: torch.device) -> "ReaderBatch":
        return ReaderBatch(**self._tensors(lambda t: t.to(device)), offsets=self.offsets, texts=self.texts)

    def take(self, rows: Sequence[int]) -> "ReaderBatch":
        """The inputs `rows` only, in that order."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return ReaderBatch(**self._tensors(lambda t: t[index.to(t.device)]), offsets=[self.offsets[r] for r in rows],
                           texts=[self.texts[r] for r in rows])

    def span_text(self, n: int, start: int, width: int) -> tuple[str, tuple[int, int]]:
        """The evidence text of span (start, width) of input n and its character offsets."""
        ev = int(self.evidence_start[n])
        offs = self.offsets[n]
        a, b = offs[start - ev][0], offs[start - ev + width][1]
        return self.texts[n][a:b], (a, b)


def valid_spans(batch: ReaderBatch, width: int) -> torch.Tensor:
    """[N, L, W] bool: spans that start and end inside the evidence (never in the question) and
    on word boundaries: a span neither starts on a `##` continuation nor ends right before one,
    as gold answers never do."""
    n, length = batch.input_ids.shape
    start = torch.arange(length, device=batch.input_ids.device).view(1, length, 1)  # [1, L, 1]
    end = start + torch.arange(width, device=start.device).view(1, 1, width)  # [1, L, W] last wordpiece
    valid = (start >= batch.evidence_start.view(n, 1, 1)) & (end < batch.evidence_end.view(n, 1, 1))  # [N, L, W]
    if batch.segment is not None:
        seg = batch.segment.to(valid.device)  # [N, L]
        seg_end = F.pad(seg, (0, width - 1), value=-1).unfold(1, width, 1)  # [N, L, W]: seg[i+w]
        valid = valid & (seg[:, :, None] == seg_end)
    if batch.word_start is None:
        return valid
    begins = batch.word_start.to(valid.device)  # [N, L]
    after = F.pad(begins, (0, width), value=True).unfold(1, width, 1)[:, 1 : length + 1]  # [N, L, W]: begins[i+w+1]
    return valid & begins[:, :, None] & after


# Where a span may not run on: a line break, or a "; " (the space after it), which data/formats.py
# puts between a table row's cells. Prose rarely has either inside an answer (48 and 0 of SQuAD
# train's 78,449 first answers).
SPAN_BOUNDARY = re.compile(r"\n|(?<=;) ")


def text_segments(text: str, starts: Sequence[int]) -> np.ndarray:
    """[len(starts)] the stretch between span boundaries of `text` that each character offset in
    `starts` lies in (0 before the first boundary)."""
    cuts = np.fromiter((m.start() for m in SPAN_BOUNDARY.finditer(text)), dtype=np.int64)
    return np.searchsorted(cuts, np.asarray(starts, dtype=np.int64), side="right")


def answer_context(text: str, span: tuple[int, int], *, before: int = 1) -> str:
    """The sentence (or line) of `text` holding the character span `span` and the `before`
    sentences ahead of it, where the subject is often named ("Van Gogh ... He painted"): what the
    verifier reads beside the question and the block's title."""
    cuts = sorted({0, *sentence_ends(text), *(m.end() for m in re.finditer(r"\n", text)), len(text)})
    at = int(np.searchsorted(cuts, span[0], side="right")) - 1  # the sentence starting at cuts[at]
    end = cuts[min(int(np.searchsorted(cuts, max(span[1] - 1, span[0]), side="right")), len(cuts) - 1)]
    return " ".join(text[cuts[max(at - before, 0)] : end].split())


class ReaderFeaturizer:
    """Turns questions and evidence texts into a reader's inputs with its tokenizer: inputs of at
    most `max_len` wordpieces (the training window), questions cut to `max_query_len`, gold spans
    of at most `max_span_width` wordpieces; `max_positions` is the encoder's position limit (None:
    it has none), which bounds the longest input it can read."""

    def __init__(self, tokenizer, *, max_len: int, max_query_len: int, max_span_width: int, max_positions: int | None,
                 read_title: bool = False, max_title_len: int = BlockConfig.max_title_len):
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.max_query_len = max_query_len
        self.max_span_width = max_span_width
        self.max_positions = max_positions
        self.read_title = read_title
        self.max_title_len = max_title_len
        self._wordpieces = wordpiece_tokenizer(tokenizer)  # no truncation: evidence is cut by join_query_evidence
        vocab = tokenizer.get_vocab()
        self._continuation = torch.zeros(max(vocab.values()) + 1, dtype=torch.bool)
        self._continuation[[i for t, i in vocab.items() if t.startswith("##")]] = True

    @property
    def max_read_len(self) -> int:
        """The longest input the encoder reads: its position embeddings, or fewer where its tokenizer
        says so (RoBERTa-style encoders reserve two); never below the training length max_len."""
        limits = [self.max_positions, getattr(self.tokenizer, "model_max_length", None)]
        return max(self.max_len, min([int(x) for x in limits if x] or [self.max_len]))

    def featurize(self, questions: Sequence[str], texts: Sequence[str], max_len: int | None = None, *,
                  titles: Sequence[str] | None = None) -> ReaderBatch:
        """One reader input per (question, evidence text) pair (both lists of length N), with
        each text's block title where the reader reads titles; the evidence is cut to what fits
        in `max_len` wordpieces (default: the training window)."""
        return self.featurize_windows(questions, texts, stride=None, max_len=max_len, titles=titles)[0]

    def featurize_windows(self, questions: Sequence[str], texts: Sequence[str], stride: int | None,
                          max_len: int | None = None, *, titles: Sequence[str] | None = None) -> tuple[ReaderBatch, list[int]]:
        """`[CLS] question [SEP] title [SEP] window [SEP]` (without the title for a reader that
        reads none) for windows of each text that start `stride` wordpieces apart (BERT's doc
        stride) until the text is covered; `stride=None` reads the first window only. `titles`
        (N, or None: none known, read as empty) are cut to `max_title_len` wordpieces. Inputs are
        at most `max_len` wordpieces (default: the training window).
        Returns (batch of every window, the pair index of each window)."""
        if len(questions) != len(texts) or (titles is not None and len(titles) != len(texts)):
            raise RalmError(f"featurize: {len(questions)} questions but {len(texts)} evidence texts"
                            + ("" if titles is None else f" and {len(titles)} titles"))
        max_len = max_len or self.max_len
        if max_len > self.max_read_len:
            raise RalmError(f"reader input length {max_len} exceeds the {self.max_read_len} wordpieces the encoder reads")
        q_enc = self._wordpieces.encode_batch(list(questions), add_special_tokens=False)
        z_enc = self._wordpieces.encode_batch(list(texts), add_special_tokens=False)
        title_ids = self._title_ids(titles, len(texts))
        rows, types, starts, ends, offsets, window_texts, owner, begins, segments = [], [], [], [], [], [], [], [], []
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        for pair, (q, z) in enumerate(zip(q_enc, z_enc)):
            title = title_ids[pair]
            room = max_len - min(len(q.ids), self.max_query_len) - 3 - (0 if title is None else len(title) + 1)
            if stride is not None and not 0 < stride <= room:
                raise RalmError(f"stride {stride} must be in 1..{room} (the evidence room of a {max_len}-wordpiece input)")
            seg = text_segments(texts[pair], [o[0] for o in z.offsets])  # [len(z)]
            first = 0
            while True:
                ids, tt, ev_start = join_query_evidence(q.ids, z.ids[first:], cls_id=cls_id, sep_id=sep_id, max_len=max_len,
                                                        max_query_len=self.max_query_len, title_ids=title)
                after = first + len(ids) - 1 - ev_start  # the text's first wordpiece past this window
                begin = [not c for c in self._is_continuation(ids).tolist()]
                begin[-1] = after >= len(z.ids) or not self._is_continuation(z.ids[after : after + 1]).item()
                rows.append(ids)
                types.append(tt)
                begins.append(begin)
                segments.append([0] * ev_start + seg[first:after].tolist() + [0])  # the final [SEP] too
                starts.append(ev_start)
                ends.append(len(ids) - 1)
                offsets.append(list(z.offsets[first:after]))
                window_texts.append(texts[pair])  # the whole text: offsets index into it
                owner.append(pair)
                if stride is None or first + room >= len(z.ids):
                    break
                first += stride
        input_ids, mask = pad_rows(rows, self.tokenizer.pad_token_id or 0)
        token_types, _ = pad_rows(types)
        segment, _ = pad_rows(segments)
        word_start = torch.ones_like(input_ids, dtype=torch.bool)
        for n, begin in enumerate(begins):
            word_start[n, : len(begin)] = torch.tensor(begin)
        return ReaderBatch(input_ids, mask, token_types, torch.tensor(starts), torch.tensor(ends), offsets, window_texts,
                           word_start, segment.long()), owner

    def _title_ids(self, titles: Sequence[str] | None, n: int) -> list[list[int] | None]:
        """Each input's title wordpieces (None: the reader reads no title)."""
        if not self.read_title:
            return [None] * n
        if titles is None:
            return [[] for _ in range(n)]
        return [e.ids[: self.max_title_len] for e in self._wordpieces.encode_batch(list(titles), add_special_tokens=False)]

    def featurize_verify(self, questions: Sequence[str], answers: Sequence[str], contexts: Sequence[str], *,
                         titles: Sequence[str] | None = None, max_len: int = 192) -> ReaderBatch:
        """The verifier's inputs: `[CLS] question [SEP] answer [SEP] title [SEP] context [SEP]`,
        one per (question, candidate answer, the answer's context: `answer_context`, block
        title); the question and answer are segment A, the rest B. The verifier judges whether
        the context states the answer for the thing and the relation the question asks about."""
        n = len(questions)
        if not len(answers) == len(contexts) == n or (titles is not None and len(titles) != n):
            raise RalmError(f"featurize_verify: {n} questions, {len(answers)} answers, {len(contexts)} contexts"
                            + ("" if titles is None else f", {len(titles)} titles"))
        sep_id = self.tokenizer.sep_token_id
        q_enc = self._wordpieces.encode_batch(list(questions), add_special_tokens=False)
        a_enc = self._wordpieces.encode_batch(list(answers), add_special_tokens=False)
        c_enc = self._wordpieces.encode_batch(list(contexts), add_special_tokens=False)
        title_ids = self._title_ids(titles, n)
        rows, types, starts, ends = [], [], [], []
        for q, a, c, title in zip(q_enc, a_enc, c_enc, title_ids):
            first = [*q.ids[: self.max_query_len], sep_id, *a.ids[: self.max_span_width]]
            ids, tt, ev_start = join_query_evidence(first, c.ids, cls_id=self.tokenizer.cls_token_id, sep_id=sep_id,
                                                    max_len=max_len, max_query_len=len(first), title_ids=title)
            rows.append(ids)
            types.append(tt)
            starts.append(ev_start)
            ends.append(len(ids) - 1)
        input_ids, mask = pad_rows(rows, self.tokenizer.pad_token_id or 0)
        token_types, _ = pad_rows(types)
        return ReaderBatch(input_ids, mask, token_types, torch.tensor(starts), torch.tensor(ends), [[] for _ in rows],
                           list(contexts))

    def _is_continuation(self, ids) -> torch.Tensor:
        """Whether each wordpiece id continues the previous word (`##...`)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        return self._continuation[ids.clamp(max=len(self._continuation) - 1)]

    def answer_match(self, batch: ReaderBatch, answers: Sequence[Sequence[str]]) -> torch.Tensor:
        """[N, L, W] bool: every valid span (`valid_spans`) whose text, SQuAD-normalised, equals a
        normalised gold answer of its input (`answers[n]`): the rule the pipeline answers by
        (pick_answer pools the spans of equal normalised text) and EM scores by, so "photons.",
        "the photons" and "Photons" are gold wherever "photons" is."""
        n, length = batch.input_ids.shape
        width = self.max_span_width
        valid = valid_spans(batch, width).cpu().numpy()  # [N, L, W]
        match = torch.zeros(n, length, width, dtype=torch.bool)
        begins = None if batch.word_start is None else batch.word_start.cpu().numpy()
        normalised: dict[str, str] = {}  # word text -> its normalised text, squeezed (words repeat)
        for i in range(n):
            gold = {normalize_answer(a) for a in answers[i]} - {""}
            if not gold:
                continue
            squeezed = {g.replace(" ", "") for g in gold}  # a cheap filter; each candidate is checked exactly
            prefixes = {g[:k] for g in squeezed for k in range(1, len(g) + 1)}
            lo, hi = int(batch.evidence_start[i]), int(batch.evidence_end[i])
            text, offs = batch.texts[i], batch.offsets[i]
            # words (a wordpiece that begins one, then its `##` continuations) and their normalised text
            firsts = list(range(lo, hi)) if begins is None else [lo, *(np.flatnonzero(begins[i, lo + 1 : hi]) + lo + 1).tolist()]
            lasts = [*(f - 1 for f in firsts[1:]), hi - 1]
            norms = []
            for a, b in zip(firsts, lasts):
                word = text[offs[a - lo][0] : offs[b - lo][1]]
                if word not in normalised:
                    normalised[word] = normalize_answer(word).replace(" ", "")
                norms.append(normalised[word])
            for s_word, first in enumerate(firsts):
                joined = ""
                for e_word in range(s_word, len(firsts)):
                    w = lasts[e_word] - first
                    if w >= width:
                        break
                    joined += norms[e_word]
                    if joined and joined not in prefixes:
                        break
                    if (joined in squeezed and valid[i, first, w]
                            and normalize_answer(text[offs[first - lo][0] : offs[lasts[e_word] - lo][1]]) in gold):
                        match[i, first, w] = True
        return match.to(batch.input_ids.device)


SPECIAL_ROLES = ("cls", "sep", "pad", "unk", "mask")


def wordpiece_map(source, target) -> torch.Tensor:
    """[source vocabulary] the id in `target`'s vocabulary of each wordpiece of `source`'s
    (special tokens by role: [CLS] -> <s>), so a teacher whose wordpieces are the student's under
    other ids (MPNet's vocabulary is BERT's uncased one, shifted) reads the student's inputs as
    they are: `replace(batch, input_ids=map[batch.input_ids])`."""
    src, tgt = source.get_vocab(), target.get_vocab()
    specials = {getattr(source, f"{r}_token_id", None): getattr(target, f"{r}_token_id", None) for r in SPECIAL_ROLES}
    specials = {s: t for s, t in specials.items() if s is not None and t is not None}
    missing = [tok for tok, i in src.items() if tok not in tgt and i not in specials]
    if len(missing) > 0.001 * len(src):
        raise RalmError(f"the teacher's wordpieces are not the student's ({len(missing)} of {len(src)} missing, e.g. "
                        f"{missing[:3]}): distillation reads both on the same windows")
    unk = getattr(target, "unk_token_id", None) or 0
    out = torch.full((max(src.values()) + 1,), unk, dtype=torch.long)
    for tok, i in src.items():
        out[i] = specials.get(i, tgt.get(tok, unk))
    return out
