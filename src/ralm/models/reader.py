"""The ORQA/REALM span reader: BERT over `[CLS] x [SEP] z_body [SEP]`, a span scorer
MLP([h_start; h_end]) over every evidence span of at most W wordpieces (on word boundaries), and
its training objective: the answer's probability under one softmax shared by every span of every
block read, weighted by p(z|x) (`shared_nll`; `marginal_nll` over K retrieved blocks), which is
how the pipeline answers.

Its inputs are made from text by `reader.featurizer` (data/reader_features.py: the windows of a
long passage, the valid and gold spans); this module scores them.

Shapes: B questions, K retrieved blocks per question, N = B*K reader inputs, L input length,
H BERT hidden size, S span-MLP hidden size, W maximum span width. A span is (start i, width w):
wordpieces i .. i+w of the input.

Checkpoint directory (HF-style): config.json (ReaderConfig + the BERT config),
model.safetensors (`bert.*`, `spans.*`), and the tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ralm.atomic import atomic_path, link_or_copy, read_json, read_weights, write_model_dir, write_text
from ralm.configs import config_from_file
from ralm.data.geometry import GEOMETRY
from ralm.data.reader_features import ReaderBatch, ReaderFeaturizer
from ralm.encoders.length_groups import by_length, length_group
from ralm.encoders.loading import assign_weights, default_model_path, encoder_from_config, load_checkpoint_tokenizer, load_hf_encoder
from ralm.errors import RalmError

FORMAT = "ralm.reader/1"
# Masked span scores: finite, so a question without any valid match yields zero gradients, not NaN.
NEG = -1e9


@dataclass
class ReaderConfig:
    span_hidden: int = 256
    max_span_width: int = 10  # W: longest answer span, in wordpieces
    span_layernorm_eps: float | None = None  # HF-REALM's span scorer: LayerNorm(eps) after the ReLU; None: none
    max_len: int = 384  # question + block body + 3 special tokens (a 288-wordpiece body fits)
    max_query_len: int = GEOMETRY.query_len
    # Train only the top N encoder layers (+ the span scorer); checkpoints then hold just those
    # tensors and rebuild the rest from `base_model`. None: everything trains and is saved.
    trainable_layers: int | None = None
    base_model: str = ""
    encoder: dict = field(default_factory=dict)  # the BERT config, to rebuild the encoder
    # raw answer score -> P(correct), fitted by `ralm eval qa --calibrate` (models/confidence.py)
    calibration: dict | None = None
    # The [CLS] span (start 0, width 0) is the reader's "no answer in this block" option: its score
    # joins the shared softmax beside the spans, weighted by p(z|x) (`shared_nll`). False: a
    # reader trained without one (its [CLS] score is untrained and never read).
    null_span: bool = False
    # Reads `[CLS] question [SEP] title [SEP] body [SEP]` (REALM's join(x, z), z = title + body):
    # the block title names what the body is about. False: readers of ralm <= 0.4, which read
    # `[CLS] question [SEP] body [SEP]` and keep doing so.
    read_title: bool = False
    # An answer verifier on the same encoder (`Reader.verify`): P(the answer's context states it
    # for the thing and relation asked) from `[CLS] question [SEP] answer [SEP] title [SEP]
    # context [SEP]`, a signal of the confidence maps. False: none.
    verifier: bool = False

    def __post_init__(self):
        if self.max_span_width <= 0 or self.span_hidden <= 0:
            raise RalmError(f"max_span_width and span_hidden must be positive, got {self.max_span_width}, {self.span_hidden}")
        if self.max_len <= self.max_query_len + 3:
            raise RalmError(f"reader max_len {self.max_len} leaves no room for evidence after a {self.max_query_len}-wordpiece question")
        if self.trainable_layers is not None and self.trainable_layers < 0:
            raise RalmError(f"trainable_layers must be >= 0, got {self.trainable_layers}")


class SpanScorer(nn.Module):
    """score(i, w) = v · relu(A h_i + B h_{i+w} + b) + c, i.e. MLP([h_start; h_end]) with the
    first layer split in two, so start and end projections are computed once per token."""

    def __init__(self, hidden: int, span_hidden: int, max_width: int, layernorm_eps: float | None = None):
        super().__init__()
        self.max_width = max_width
        self.start = nn.Linear(hidden, span_hidden)
        self.end = nn.Linear(hidden, span_hidden, bias=False)
        self.norm = nn.LayerNorm(span_hidden, eps=layernorm_eps) if layernorm_eps is not None else nn.Identity()
        self.out = nn.Linear(span_hidden, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[N, L, H] -> [N, L, W]; entries past the end of the input are garbage (masked later)."""
        start = self.start(h)  # [N, L, S]
        end = F.pad(self.end(h), (0, 0, 0, self.max_width - 1))  # [N, L+W-1, S]
        end = rearrange(end.unfold(1, self.max_width, 1), "n l s w -> n l w s")  # [N, L, W, S]: end i+w
        return self.out(self.norm(torch.relu(start.unsqueeze(2) + end))).squeeze(-1)  # [N, L, W]


def _per_question_lse(values: torch.Tensor, question: torch.Tensor, questions: int) -> torch.Tensor:
    """[B] log Σ_{n of question b} exp values[n]; values [N]."""
    owns = question.view(1, -1) == torch.arange(questions, device=question.device).view(-1, 1)  # [B, N]
    return torch.logsumexp(values.view(1, -1).masked_fill(~owns, NEG), 1)


def shared_nll(scores: torch.Tensor, valid: torch.Tensor, match: torch.Tensor, *, log_pz: torch.Tensor,
               question: torch.Tensor, questions: int, null: torch.Tensor | None = None,
               no_answer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reading objective with one softmax over every span of every input read for a question
    (shared normalisation, Clark & Gardner 2018), averaged over the questions it labels:

        -log Σ_n Σ_{s in n matching} p(z_n|x) exp f(s) / C,   C = Σ_n p(z_n|x) (exp g_n + Σ_{s valid in n} exp f(s))

    which is the answer probability the pipeline reads (pipeline.pick_answer). Inputs without a
    matching span still raise C: a block without the answer must score below one with it.

    scores, valid, match: [N, L, W] span scores f, valid spans, spans whose text is an answer;
    log_pz [N]: log p(z|x) of the block input n reads (the windows of one block share it);
    question [N]: which of the `questions` questions input n belongs to.
    null [N] (optional): the score g_n of input n's null span, the reader's "no answer here"
    option (without it, C has no g term). A question marked in `no_answer` [B] whose inputs hold
    no matching span is labelled with the null: its loss is -log Σ_n p(z_n|x) exp g_n / C, so
    "the answer is not in what I read" is learnt, not inferred. Any other question whose answer
    matches no span of its inputs contributes exactly zero (value and gradient).
    Returns (loss, labelled [questions] bool: the questions that count).
    """
    match = match & valid
    flat = scores.float().masked_fill(~valid, NEG).flatten(1)  # [N, L*W]
    log_spans = torch.logsumexp(flat, 1)  # [N]
    log_all = (log_spans if null is None else torch.logaddexp(log_spans, null.float())) + log_pz  # [N]
    log_gold = torch.logsumexp(flat.masked_fill(~match.flatten(1), NEG), 1) + log_pz  # [N]
    log_c = _per_question_lse(log_all, question, questions)  # [B]
    log_y = _per_question_lse(log_gold, question, questions)  # [B]
    has_span = torch.zeros(questions, dtype=torch.long, device=scores.device).index_add(
        0, question, match.flatten(1).any(1).long()) > 0  # [B]
    labelled = has_span
    if null is not None and no_answer is not None:
        to_null = no_answer.to(has_span.device) & ~has_span
        log_y = torch.where(to_null, _per_question_lse(null.float() + log_pz, question, questions), log_y)
        labelled = has_span | to_null
    per_question = torch.where(labelled, log_c - log_y, torch.zeros_like(log_y))
    return per_question.sum() / labelled.sum().clamp(min=1), labelled


def distill_kl(scores: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, *, log_pz: torch.Tensor,
               question: torch.Tensor, questions: int, null: torch.Tensor | None = None,
               teacher_null: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Knowledge distillation on the reading softmax: KL(p_teacher || p_student) of one softmax
    per question over every valid span (and null span, when both give one) of every input read,
    as `shared_nll` defines it, at `temperature` T, times T^2 (Hinton et al., 2015), averaged over
    questions. scores, teacher, valid: [N, L, W] (the teacher read the same wordpieces);
    null, teacher_null: [N] or None; log_pz, question: as `shared_nll`."""
    if (null is None) != (teacher_null is None):
        raise RalmError("distillation needs a null score from both the student and the teacher, or from neither")

    def log_probs(f: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        flat = (f.float() / temperature).masked_fill(~valid, NEG).flatten(1)  # [N, L*W]
        if g is not None:
            flat = torch.cat([flat, g.float()[:, None] / temperature], 1)  # [N, L*W + 1]
        flat = flat + log_pz[:, None]
        log_c = _per_question_lse(torch.logsumexp(flat, 1), question, questions)  # [B]
        return flat - log_c[question][:, None]

    lt, ls = log_probs(teacher.detach(), None if teacher_null is None else teacher_null.detach()), log_probs(scores, null)
    kl = (lt.exp() * (lt - ls)).sum(1)  # [N]; masked entries have p_teacher = 0
    per_question = torch.zeros(questions, device=kl.device).index_add(0, question, kl)  # [B]
    return per_question.mean() * temperature**2


def marginal_nll(scores: torch.Tensor, valid: torch.Tensor, match: torch.Tensor, retrieval_logits: torch.Tensor, *,
                 null: torch.Tensor | None = None, no_answer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-log p(y|x) for K retrieved blocks per question, with p(z|x) the softmax of
    `retrieval_logits` [B, K] and one span softmax shared by the K blocks (`shared_nll`), not one
    per block. scores, valid, match: [B, K, L, W]; null [B, K] and no_answer [B]: as `shared_nll`.
    Returns (loss, labelled [B] bool)."""
    b, k = retrieval_logits.shape
    question = torch.arange(b, device=scores.device).repeat_interleave(k)  # [B*K]
    log_pz = torch.log_softmax(retrieval_logits.float(), -1).flatten()  # [B*K]
    return shared_nll(scores.flatten(0, 1), valid.flatten(0, 1), match.flatten(0, 1), log_pz=log_pz,
                      question=question, questions=b, null=None if null is None else null.flatten(), no_answer=no_answer)


def best_spans(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The highest-scoring valid span of each input: (start [N], width [N], log p(span|z,x) [N])."""
    f, start, width, log_norm = top_spans(scores, valid, 1)
    return start[:, 0], width[:, 0], f[:, 0] - log_norm


def top_spans(scores: torch.Tensor, valid: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n highest-scoring valid spans of each input: (score [N, n], start [N, n], width [N, n],
    log_norm [N]), log_norm = log Σ exp(score) over all the input's valid spans (so score - log_norm
    is log p(span|z,x), and inputs can share one softmax). Invalid fillers score below NEG / 2."""
    flat = scores.float().masked_fill(~valid, NEG).flatten(1)  # [N, L*W]
    top = torch.topk(flat, min(n, flat.shape[1]), dim=1)
    width = scores.shape[-1]
    return top.values, top.indices // width, top.indices % width, torch.logsumexp(flat, 1)


class Reader(nn.Module):
    def __init__(self, bert: nn.Module, tokenizer, cfg: ReaderConfig):
        super().__init__()
        self.bert = bert
        self.spans = SpanScorer(bert.config.hidden_size, cfg.span_hidden, cfg.max_span_width, cfg.span_layernorm_eps)
        self.tokenizer = tokenizer
        self.cfg = cfg
        positions = getattr(bert.config, "max_position_embeddings", None)
        if positions is not None and cfg.max_len > positions:
            raise RalmError(f"reader max_len {cfg.max_len} exceeds the encoder's {positions} positions")
        self.featurizer = ReaderFeaturizer(tokenizer, max_len=cfg.max_len, max_query_len=cfg.max_query_len,
                                           max_span_width=cfg.max_span_width, max_positions=positions, read_title=cfg.read_title)
        self.verify_head = nn.Linear(bert.config.hidden_size, 1) if cfg.verifier else None
        if cfg.trainable_layers is not None:
            layers = bert.config.num_hidden_layers
            if cfg.trainable_layers > layers:
                raise RalmError(f"trainable_layers {cfg.trainable_layers} exceeds the encoder's {layers} layers")
            for name, p in self.bert.named_parameters():
                p.requires_grad_(self._is_trained(f"bert.{name}"))

    def _is_trained(self, key: str) -> bool:
        """Whether a state-dict key belongs to the trained (and saved) part of the model."""
        if self.cfg.trainable_layers is None or key.startswith(("spans.", "verify_head.")):
            return True
        first = self.bert.config.num_hidden_layers - self.cfg.trainable_layers
        parts = key.split(".")
        return key.startswith("bert.encoder.layer.") and int(parts[3]) >= first

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def fingerprint(self) -> str:
        """A short hash of the span scorer's and the top encoder layer's weights: which reader a
        confidence map was fitted with (models/confidence.py `fitted_with`)."""
        top = f"bert.encoder.layer.{self.bert.config.num_hidden_layers - 1}."
        digest = hashlib.sha256()
        for key, value in sorted(self.state_dict().items()):
            if key.startswith(("spans.", "verify_head.", top)):
                digest.update(key.encode())
                digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def __repr__(self) -> str:
        """One line (nn.Module's tree view: `print(nn.Module.__repr__(reader))`)."""
        c, enc = self.cfg, self.bert.config
        return (f"Reader(encoder={getattr(enc, 'model_type', 'bert')} {enc.num_hidden_layers}x{enc.hidden_size}, max_len={c.max_len}, "
                f"max_span_width={c.max_span_width}, read_title={c.read_title}, verifier={c.verifier}, "
                f"calibrated={c.calibration is not None}, base_model={c.base_model!r})")

    def reading_titles(self) -> "Reader":
        """This reader, reading block titles from now on (a reader of ralm <= 0.4 being
        fine-tuned into the new input: `ralm train-reader` does it)."""
        self.cfg.read_title = True
        self.featurizer.read_title = True
        return self

    def with_verifier(self) -> "Reader":
        """This reader with an answer verifier head (fresh, on the device of its weights) if it
        has none yet."""
        if self.verify_head is None:
            self.cfg.verifier = True
            self.verify_head = nn.Linear(self.bert.config.hidden_size, 1).to(self.device)
        return self

    def forward(self, batch: ReaderBatch) -> torch.Tensor:
        """Span scores [N, L, W] (mask them with `valid_spans`)."""
        length = batch.input_ids.shape[1]
        return self._encoded(batch, lambda h: F.pad(self.spans(h), (0, 0, 0, length - h.shape[1])))  # padding: never valid

    def verify(self, batch: ReaderBatch) -> torch.Tensor:
        """[N] the verifier's logits of P(supported) for `featurize_verify` inputs."""
        if self.verify_head is None:
            raise RalmError("this reader has no verifier (config verifier: false); train one with `ralm train-reader --verify`")
        return self._encoded(batch, lambda h: self.verify_head(h[:, 0]).squeeze(-1))  # [G] from [CLS]

    def _encoded(self, batch: ReaderBatch, head) -> torch.Tensor:
        """`head(h)` of the encoder's states h [G, m, H] for the inputs, read in groups of similar
        length, each cut to its longest, so no attention or FFN work goes to padding (blocks vary
        from a few dozen wordpieces to max_len); the groups' outputs back in input order."""
        lengths = batch.attention_mask.sum(1).tolist()
        segments = getattr(self.bert.config, "type_vocab_size", 0) > 1  # encoders without segments (MPNet) take none

        def run(rows: list[int]) -> torch.Tensor:
            m = max(lengths[r] for r in rows)
            pick = torch.as_tensor(rows, device=batch.input_ids.device)
            extra = {"token_type_ids": batch.token_type_ids[pick, :m]} if segments else {}
            h = self.bert(input_ids=batch.input_ids[pick, :m], attention_mask=batch.attention_mask[pick, :m],
                          **extra).last_hidden_state  # [G, m, H]
            return head(h)

        return by_length(lengths, run, length_group(batch.input_ids.device))

    def null_scores(self, scores: torch.Tensor) -> torch.Tensor | None:
        """[N] each input's null-span score (its [CLS] span, start 0 width 0) from the span scores
        [N, L, W], or None for a reader trained without one (cfg.null_span)."""
        return scores[:, 0, 0] if self.cfg.null_span else None

    # -- save / load -------------------------------------------------------------------------
    def save_pretrained(self, out: str | os.PathLike) -> None:
        state = {k: v for k, v in self.state_dict().items() if self._is_trained(k)}
        write_model_dir(out, state, self.tokenizer, fmt=FORMAT, config=asdict(self.cfg))

    @classmethod
    def from_encoder(cls, path: str | os.PathLike | None = None, **overrides) -> "Reader":
        """A fresh reader (random span scorer) on a BERT-like HF directory or hub name; `None`
        or "default" gives the bundled MiniLM. A BertForMaskedLM directory (a REALM-pretrained
        knowledge-augmented encoder) works too: its LM head is dropped."""
        name = "default" if path in (None, "", "default") else str(path)
        bert, tokenizer = load_hf_encoder(default_model_path() if name == "default" else name)
        return cls(bert, tokenizer, ReaderConfig(base_model=name, encoder=bert.config.to_dict(), **overrides))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None, **overrides) -> "Reader":
        """A reader checkpoint directory written by `save_pretrained`; `None` gives the
        package's general-purpose reader. `overrides` replace saved ReaderConfig fields (e.g.
        max_len, calibration)."""
        path = default_reader_path() if path is None else Path(path)
        if not is_reader_dir(path):
            raise RalmError(f"{path}: not a reader checkpoint (expected config.json with format {FORMAT!r})")
        raw = read_json(path / "config.json")
        raw.pop("format")
        cfg = replace(config_from_file(ReaderConfig, raw, path / "config.json"), **overrides)
        if cfg.trainable_layers is not None:  # the frozen part comes from the base encoder
            base = cfg.base_model
            bert, _ = load_hf_encoder(default_model_path() if base == "default" else base)
        else:
            bert = encoder_from_config(cfg.encoder, path / "config.json")  # every weight comes from the checkpoint
        model = cls(bert, load_checkpoint_tokenizer(path), cfg)
        missing, unexpected = assign_weights(model, read_weights(path), path)
        missing = [k for k in missing if not k.endswith("position_ids") and model._is_trained(k)]
        if missing or unexpected:
            raise RalmError(f"{path}: checkpoint does not match its config (missing {missing[:5]}, unexpected {unexpected[:5]})")
        return model


def is_reader_dir(path: str | os.PathLike) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and read_json(p).get("format") == FORMAT


def default_reader_path() -> Path:
    """The general-purpose reader shipped in the package (ralm/data/reader): what answers when
    no --model is given. Replacing the shipped weights is a copy into this directory."""
    return Path(str(resources.files("ralm.data") / "reader"))


def write_calibration(path: str | os.PathLike, calibration: dict) -> None:
    """Store a fitted calibration in a reader checkpoint's config.json (weights untouched)."""
    path = Path(path)
    if not is_reader_dir(path):
        raise RalmError(f"{path}: not a reader checkpoint (expected config.json with format {FORMAT!r})")
    config = json.loads((path / "config.json").read_text())
    write_text(path / "config.json", json.dumps({**config, "calibration": calibration}, indent=2) + "\n")


def save_calibrated(source: str | os.PathLike, out: str | os.PathLike, calibration: dict) -> Path:
    """A copy of the reader at `source` with `calibration` in its config.json, written to the
    new directory `out` atomically; the source (perhaps the installed package's) is untouched."""
    source, out = Path(source), Path(out)
    if not is_reader_dir(source):
        raise RalmError(f"{source}: not a reader checkpoint (expected config.json with format {FORMAT!r})")
    with atomic_path(out) as tmp:
        tmp.mkdir()
        for f in source.iterdir():
            if f.is_file() and f.name != "config.json":
                link_or_copy(f, tmp / f.name)
        config = json.loads((source / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "calibration": calibration}, indent=2) + "\n")
    return out
