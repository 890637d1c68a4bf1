"""Hugging Face REALM checkpoints (transformers 4.x `RealmEmbedder`, `RealmScorer`,
`RealmKnowledgeAugEncoder`, `RealmReader`, `RealmForOpenQA`) -> our checkpoint directories.

Where the released architecture differs from the paper's text, our modules have an option
that reproduces it, set here:
  retriever  [CLS] -> BERT's tanh pooler -> Linear -> LayerNorm  (pooling="pooler", proj_layernorm);
             blocks `[CLS] title [SEP] body [SEP]` as RealmTokenizer's (title, body) pairs, segment
             id 1 on the body (pair_sep_id: the towers derive it from the first [SEP])
  reader     relu(start(h_i) + end(h_j)) -> LayerNorm(eps 1e-3) -> Linear  (span_layernorm_eps);
             HF's `dense_intermediate` [2S, H] is our start/end pair: rows :S start, S: end,
             and one bias b_start + b_end (the two biases are only ever summed)
  all BERTs  `hidden_act` (gelu_new in the released models), eps, sizes from the config

Tensors the converted models do not use are dropped and listed in the summary: the MLM heads
inside `RealmScorerProjection` and `RealmReader` (never called in their forward passes), the
knowledge-augmented encoder's pooler, and `RealmForOpenQA.block_emb` (precomputed embeddings of
the released corpus; our index is built from the corpus with `ralm index build`). Any other
name, or a missing one, is an error listing them.

Shapes: H hidden size, S span hidden size.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ralm.atomic import read_json, write_json
from ralm.configs import ConfigError
from ralm.data.geometry import GEOMETRY
from ralm.errors import RalmError, first_line
from ralm.rundir import final_dir

ARCHITECTURES = ("RealmEmbedder", "RealmScorer", "RealmKnowledgeAugEncoder", "RealmReader", "RealmForOpenQA")
# Per architecture, the source tensors no converted module uses (see the module docstring).
IGNORED = {
    "RealmEmbedder": re.compile(r"^cls\.predictions\."),
    "RealmScorer": re.compile(r"^(query_)?embedder\.cls\.predictions\."),
    "RealmKnowledgeAugEncoder": re.compile(r"^realm\.pooler\."),
    "RealmReader": re.compile(r"^cls\.predictions\."),
    "RealmForOpenQA": re.compile(r"^(embedder|reader)\.cls\.predictions\.|^block_emb$"),
}
# Runtime buffers some BERT versions save; rebuilt from the config.
BUFFERS = re.compile(r"(position_ids|token_type_ids)$")
_BERT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
              "initializer_range", "layer_norm_eps", "pad_token_id", "position_embedding_type", "tie_word_embeddings")


@dataclass
class HfRealmCheckpoint:
    """An HF-REALM model directory as read from disk."""

    path: Path
    architecture: str
    config: dict
    state: dict[str, torch.Tensor]  # the tensors to convert
    ignored: list[str]  # source tensors no converted module uses, and saved runtime buffers


# -- reading -----------------------------------------------------------------------------------

def read_checkpoint(path: str | os.PathLike) -> HfRealmCheckpoint:
    """config.json + weights (model.safetensors, pytorch_model.bin, or their sharded index)."""
    path = Path(path)
    if not path.is_dir():
        raise RalmError(f"{path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise RalmError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise RalmError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None
    if config.get("model_type") != "realm":
        raise RalmError(f"{cfg_file}: model_type is {config.get('model_type')!r}, not 'realm'; "
                        f"`ralm convert hf-realm` reads Hugging Face REALM checkpoints only")
    state = read_weights(path)
    arch = detect_architecture(config, state, cfg_file)
    ignored = {k for k in state if IGNORED[arch].search(k) or BUFFERS.search(k)}
    return HfRealmCheckpoint(path, arch, config, {k: v for k, v in state.items() if k not in ignored}, sorted(ignored))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    def load_safetensors(f: Path) -> dict:
        try:
            return load_file(str(f))
        except Exception as e:  # a truncated or foreign file
            raise RalmError(f"{f}: unreadable safetensors file ({first_line(e)})") from None

    def load_bin(f: Path) -> dict:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise RalmError(f"{f}: not a plain tensor checkpoint ({type(e).__name__}); "
                            f"only weights are loaded, never pickled objects") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise RalmError(f"{f}: expected a flat {{name: tensor}} state dict")
        return state

    for name, load in (("model.safetensors", load_safetensors), ("pytorch_model.bin", load_bin)):
        if (path / name).is_file():
            return load(path / name)
        index = path / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in load(path / shard).items()}
    raise RalmError(f"{path}: no weights (model.safetensors, pytorch_model.bin or a sharded index of either)")


def detect_architecture(config: dict, state: dict, where: Path) -> str:
    """The REALM class that saved the weights: config `architectures`, else the key layout."""
    named = [a for a in config.get("architectures") or [] if a in ARCHITECTURES]
    if named:
        return named[0]
    keys = set(state)
    if "block_emb" in keys or any(k.startswith("reader.") for k in keys):
        return "RealmForOpenQA"
    if any(k.startswith("embedder.") for k in keys):
        return "RealmScorer"
    if any(k.startswith("qa_outputs.") for k in keys):
        return "RealmReader"
    if any(k.startswith("cls.dense.") for k in keys):
        return "RealmEmbedder"
    if any(k.startswith("cls.predictions.") for k in keys):
        return "RealmKnowledgeAugEncoder"
    raise RalmError(f"{where}: cannot tell which REALM model this is (architectures {config.get('architectures')}); "
                    f"expected one of {', '.join(ARCHITECTURES)}")


def bert_config(config: dict) -> dict:
    """The BERT config of every REALM tower (model_type bert, hidden_act and sizes kept)."""
    return {"model_type": "bert", **{k: config[k] for k in _BERT_KEYS if k in config}}


def load_tokenizer(path: Path):
    """HF's RealmTokenizer is a BERT wordpiece tokenizer; read it as one (tokenizer.json or
    vocab.txt, with the directory's lower-casing and special tokens)."""
    from transformers import BertTokenizerFast

    if not ((path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file()):
        raise RalmError(f"{path}: no tokenizer (tokenizer.json or vocab.txt); copy the model's tokenizer files there")
    tokenizer = BertTokenizerFast.from_pretrained(str(path))
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise RalmError(f"{path}: the tokenizer has no [CLS]/[SEP] tokens")
    return tokenizer


# -- name mapping ------------------------------------------------------------------------------

def rename(state: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every tensor under a source prefix, renamed to the matching target prefix (first match)."""
    out = {}
    for name, t in state.items():
        for src, dst in prefixes.items():
            if name.startswith(src):
                out[dst + name[len(src):]] = t
                break
    return out


def tower_names(src: str, dst: str) -> dict[str, str]:
    """RealmEmbedder under `src` -> our retriever Tower under `dst`."""
    return {f"{src}realm.": f"{dst}.bert.", f"{src}cls.dense.": f"{dst}.proj.", f"{src}cls.LayerNorm.": f"{dst}.norm."}


ENCODER_NAMES = {"realm.": "mlm.bert.", "cls.predictions.": "mlm.cls.predictions."}


def encoder_state(state: dict[str, torch.Tensor], tie: bool) -> dict[str, torch.Tensor]:
    """RealmKnowledgeAugEncoder -> KnowledgeAugmentedEncoder (a BertForMaskedLM under `mlm.`).
    Tied output layers are often saved without their decoder tensors: restore the ties."""
    out = rename(state, ENCODER_NAMES)
    if "mlm.cls.predictions.decoder.weight" not in out and tie and "mlm.bert.embeddings.word_embeddings.weight" in out:
        out["mlm.cls.predictions.decoder.weight"] = out["mlm.bert.embeddings.word_embeddings.weight"]
    if "mlm.cls.predictions.decoder.bias" not in out and "mlm.cls.predictions.bias" in out:
        out["mlm.cls.predictions.decoder.bias"] = out["mlm.cls.predictions.bias"]
    return out


def reader_names(src: str) -> dict[str, str]:
    """RealmReader under `src` -> our Reader; `dense_intermediate` is split (see reader_state)."""
    return {f"{src}realm.": "bert.", f"{src}qa_outputs.dense_output.": "spans.out.",
            f"{src}qa_outputs.layer_normalization.": "spans.norm."}


def reader_sources(src: str) -> dict[str, str]:
    """Our reader prefixes -> the HF ones (both span projections come from `dense_intermediate`)."""
    split = f"{src}qa_outputs.dense_intermediate."
    return {v: k for k, v in reader_names(src).items()} | {"spans.start.": split, "spans.end.": split}


def reader_state(state: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
    """RealmReader under `src` -> our Reader: `bert.*` and the span scorer `spans.*`."""
    out = rename(state, reader_names(src))
    w, b = state.get(f"{src}qa_outputs.dense_intermediate.weight"), state.get(f"{src}qa_outputs.dense_intermediate.bias")
    if w is not None and b is not None:
        s = w.shape[0] // 2  # [2S, H]: chunk(2) gives the start then the end projection
        out |= {"spans.start.weight": w[:s], "spans.start.bias": b[:s] + b[s:], "spans.end.weight": w[s:]}
    return out


def consumed(state: dict[str, torch.Tensor], prefixes) -> set[str]:
    """Source names a conversion reads: everything under the source prefixes of its mapping
    (a name there that the target lacks is caught by `load_into`)."""
    return {k for k in state if any(k.startswith(p) for p in prefixes)}


def check_unknown(ckpt: HfRealmCheckpoint, used: set[str]) -> None:
    """Error on source tensors that no converted module reads (nothing is dropped silently)."""
    unknown = sorted(k for k in ckpt.state if k not in used)
    if unknown:
        raise RalmError(f"{ckpt.path}: {len(unknown)} unknown tensor name(s) for {ckpt.architecture}: {', '.join(unknown[:20])}"
                        + (" ..." if len(unknown) > 20 else ""))


def source_name(key: str, sources: dict[str, str]) -> str:
    """Our tensor name -> the HF name it is read from; `sources` maps our prefixes to theirs."""
    for dst, src in sources.items():
        if key.startswith(dst):
            return src + key[len(dst):]
    return key


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str, sources: dict[str, str]) -> None:
    """Strict load that names what is missing (by its HF name) or unexpected (position-id
    buffers excepted). `sources` maps our name prefixes to the HF ones they come from."""
    expected = module.state_dict()
    missing = sorted({source_name(k, sources) for k in expected if k not in state and not BUFFERS.search(k)})
    unexpected = sorted(k for k in state if k not in expected)
    wrong = sorted({f"{source_name(k, sources)} is {tuple(state[k].shape)}, the config implies {tuple(expected[k].shape)}"
                    for k in state if k in expected and state[k].shape != expected[k].shape})
    if missing or unexpected or wrong:
        parts = [f"{label}: {', '.join(names[:20])}" + (" ..." if len(names) > 20 else "")
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]
        raise RalmError(f"{where}: tensors do not match the converted model ({'; '.join(parts)})")
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)


# -- building our modules ----------------------------------------------------------------------

def _bert(config: dict):
    from ralm.encoders.loading import bert_from_config

    return bert_from_config(bert_config(config))


def build_retriever(ckpt: HfRealmCheckpoint, tokenizer, *, query_prefix: str, doc_prefix: str | None,
                    doc: HfRealmCheckpoint | None = None):
    """Retriever from one or two RealmEmbedders in `ckpt` (`doc_prefix` None: the document tower
    comes from `doc`, another embedder checkpoint, or else is a copy of the query tower)."""
    from ralm.retrieval.towers.encoders import Retriever, RetrieverConfig, Tower

    positions = ckpt.config.get("max_position_embeddings", 512)
    cfg = RetrieverConfig(dim=ckpt.config.get("retriever_proj_size", 128), pooling="pooler", proj_layernorm=True,
                          pair_sep_id=tokenizer.sep_token_id,
                          query_max_len=min(GEOMETRY.query_len, positions), block_max_len=min(GEOMETRY.block_len, positions), projection_ready=True,
                          base_model=str(ckpt.path), encoder=bert_config(ckpt.config))
    model = Retriever(Tower(_bert(ckpt.config), cfg), Tower(_bert(ckpt.config), cfg), tokenizer, cfg)
    state = rename(ckpt.state, tower_names(query_prefix, "query"))
    if doc_prefix is not None:
        state |= rename(ckpt.state, tower_names(doc_prefix, "doc"))
    elif doc is not None:
        state |= rename(doc.state, tower_names(_embedder_prefix(doc), "doc"))
    else:
        state |= {"doc." + k[len("query."):]: v for k, v in state.items()}
    sources = {dst: src for src, dst in tower_names(query_prefix, "query").items()}
    if doc_prefix is not None or doc is not None:
        sources |= {dst: src for src, dst in tower_names(_embedder_prefix(doc) if doc_prefix is None else doc_prefix, "doc").items()}
    load_into(model, state, str(ckpt.path), sources)
    return model


def _embedder_prefix(ckpt: HfRealmCheckpoint) -> str:
    """Where the (document) embedder lives in a checkpoint given as --doc-embedder."""
    prefixes = {"RealmEmbedder": "", "RealmScorer": "embedder."}
    if ckpt.architecture not in prefixes:
        raise RalmError(f"{ckpt.path}: a document embedder must be a RealmEmbedder or RealmScorer, got {ckpt.architecture}")
    return prefixes[ckpt.architecture]


def build_encoder(ckpt: HfRealmCheckpoint, tokenizer):
    from transformers import BertConfig, BertForMaskedLM

    from ralm.models.realm import KnowledgeAugmentedEncoder

    enc = bert_config(ckpt.config)
    enc.pop("model_type")
    mlm = BertForMaskedLM(BertConfig(**enc))
    model = KnowledgeAugmentedEncoder(mlm, tokenizer)
    state = encoder_state(ckpt.state, ckpt.config.get("tie_word_embeddings", True))
    load_into(model, state, str(ckpt.path), {dst: src for src, dst in ENCODER_NAMES.items()})
    return model


def build_reader(ckpt: HfRealmCheckpoint, tokenizer, prefix: str):
    from ralm.models.reader import Reader, ReaderConfig

    c = ckpt.config
    max_len = min(c.get("reader_seq_len", 320), c.get("max_position_embeddings", 512))
    cfg = ReaderConfig(span_hidden=c.get("span_hidden_size", 256), max_span_width=c.get("max_span_width", 10),
                       max_len=max_len, max_query_len=min(GEOMETRY.query_len, max_len // 2), span_layernorm_eps=c.get("reader_layer_norm_eps", 1e-3),
                       base_model=str(ckpt.path), encoder=bert_config(c))
    model = Reader(_bert(c), tokenizer, cfg)
    load_into(model, reader_state(ckpt.state, prefix), str(ckpt.path), reader_sources(prefix))
    return model


# -- the conversion ----------------------------------------------------------------------------

def source_prefixes(ckpt: HfRealmCheckpoint) -> dict[str, tuple]:
    """component -> where its tensors live in the source: (query, doc) embedder prefixes for
    the retriever (doc None: the checkpoint has no document tower), one prefix otherwise."""
    arch, keys = ckpt.architecture, ckpt.state.keys()
    if arch == "RealmEmbedder":
        return {"retriever": ("", "")}
    if arch == "RealmScorer":  # the query embedder is saved under its own name only when it is a separate module
        return {"retriever": ("query_embedder." if any(k.startswith("query_embedder.") for k in keys) else "embedder.", "embedder.")}
    if arch == "RealmKnowledgeAugEncoder":
        return {"encoder": ("",)}
    if arch == "RealmReader":
        return {"reader": ("",)}
    return {"retriever": ("embedder.", None), "reader": ("reader.",)}


def convert_hf_realm(src: str | os.PathLike, run: str | os.PathLike, doc_embedder: str | os.PathLike | None = None) -> dict:
    """Convert an HF-REALM directory into RUN/final/{retriever,encoder,reader} (whichever the
    source holds; other components already in RUN are kept) and record the source of each in
    RUN/final/conversion.json. Returns the summary of this conversion.

    A RealmForOpenQA checkpoint has no document tower (its block embeddings were precomputed):
    `doc_embedder` names a RealmEmbedder/RealmScorer directory for it, else the query embedder
    is copied (then build a fresh index with the converted retriever).
    """
    ckpt = read_checkpoint(src)
    plan = source_prefixes(ckpt)
    if doc_embedder is not None and plan.get("retriever", (None, ""))[1] is not None:
        raise ConfigError("doc_embedder", f"applies to RealmForOpenQA checkpoints only; {ckpt.path} is a {ckpt.architecture}")
    # Check the names before building anything: every tensor must land somewhere.
    used: set[str] = set()
    for name, prefixes in plan.items():
        if name == "retriever":
            query, doc = prefixes
            used |= consumed(ckpt.state, [*tower_names(query, "query"), *(tower_names(doc, "doc") if doc is not None else [])])
        elif name == "encoder":
            used |= consumed(ckpt.state, ENCODER_NAMES)
        else:
            used |= consumed(ckpt.state, set(reader_sources(prefixes[0]).values()))
    check_unknown(ckpt, used)

    tokenizer = load_tokenizer(ckpt.path)
    summary: dict = {"source": str(ckpt.path), "architecture": ckpt.architecture, "components": {}}
    models = {}
    if "retriever" in plan:
        query, doc = plan["retriever"]
        doc_ckpt = read_checkpoint(doc_embedder) if doc_embedder is not None else None
        models["retriever"] = build_retriever(ckpt, tokenizer, query_prefix=query, doc_prefix=doc, doc=doc_ckpt)
        if doc is not None:
            summary["doc_tower"] = "separate embedder" if doc != query else "shared with the query tower"
        else:
            summary["doc_tower"] = f"from {doc_ckpt.path}" if doc_ckpt else "copied from the query embedder"
    if "encoder" in plan:
        models["encoder"] = build_encoder(ckpt, tokenizer)
    if "reader" in plan:
        models["reader"] = build_reader(ckpt, tokenizer, plan["reader"][0])
    summary["ignored_tensors"] = ckpt.ignored
    final = final_dir(run)
    for name, model in models.items():
        model.save_pretrained(final / name)
        summary["components"][name] = str(final / name)
    # One record per component, so a RUN can combine sources (e.g. a scorer and an encoder).
    record = final / "conversion.json"
    history = read_json(record) if record.is_file() else {}
    history.update({name: {k: v for k, v in summary.items() if k != "components"} for name in models})
    write_json(record, history)
    return summary
