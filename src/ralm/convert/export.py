"""Export: ralm's retrievers and readers into the directories other libraries load as they are.

  retriever, sentence-transformers   OUT/query/ and OUT/document/, one SentenceTransformer each:
                                     the BERT at the root (a plain Hugging Face directory too),
                                     1_Pooling (cls or mean), [2_Normalize], [3_Dense: the
                                     projection, identity activation]; similarity: dot product
  retriever, hf                      OUT/query/ and OUT/document/, plain BertModel directories,
                                     with the pooling and projection in ralm_head.json and
                                     ralm_head.safetensors ({"weight" [D, H], "bias" [D]})
  reader, hf                         OUT/: the BertModel directory, the span scorer in
                                     span_scorer.safetensors and its config in ralm_reader.json
  reader, package                    OUT/: the reader checkpoint as the package ships it
                                     (src/ralm/data/reader): fp16 weights in two shards, the
                                     word embeddings and the rest (no file over 30 MB), config,
                                     tokenizer and made_by.json as they are; loading casts back
                                     to fp32

An exported tower gives the vectors of ralm's (tests/test_export.py): documents are encoded as
the index encodes blocks, `title [SEP] text` (with an empty title: ` [SEP] text`); query vectors
lack the fixed `score_scale` factor ralm applies to queries (recorded in ralm_head.json and in
config_sentence_transformers.json), which changes no ranking.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from ralm.atomic import atomic_path
from ralm.errors import RalmError, RalmWarning
from ralm.retrieval.towers.encoders import Retriever, Tower, is_retriever_dir
from ralm.runtime import check_finite

FORMATS = ("sentence-transformers", "hf", "package")


PARTS = ("retriever", "reader")


def export_model(source: str | os.PathLike, out: str | os.PathLike, fmt: str, *, part: str | None = None) -> dict:
    """Export the retriever or reader at `source` (a checkpoint directory, or a run: its
    RUN/final/<part>) into `out` (created; must not exist). A run holding both needs `part`.
    Returns {"kind", "source", "format", "out", "parts": {name: path}}."""
    from ralm.models.reader import is_reader_dir
    from ralm.rundir import find_model

    if fmt not in FORMATS:
        raise RalmError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if part is not None and part not in PARTS:
        raise RalmError(f"--part must be retriever or reader, got {part!r}")
    out = Path(out)
    if out.exists():
        raise RalmError(f"{out} exists; export into a new directory")
    found = {name: find_model(source, name, accept) for name, accept in (("retriever", is_retriever_dir), ("reader", is_reader_dir))
             if part in (None, name)}
    found = {name: path for name, path in found.items() if path is not None}
    if not found:
        what = f"a {part} checkpoint, nor a run with RUN/final/{part}" if part else \
            "a retriever nor a reader checkpoint, nor a run with RUN/final/retriever or RUN/final/reader"
        raise RalmError(f"{source}: neither {what}")
    if len(found) > 1:
        raise RalmError(f"{source} holds a retriever and a reader: name the one to export with --part retriever or --part reader")
    (name, path), = found.items()
    return (_export_retriever if name == "retriever" else _export_reader)(path, out, fmt)


def _export_retriever(found: Path, out: Path, fmt: str) -> dict:
    retriever = Retriever.from_pretrained(found)
    check_finite(retriever, str(found))
    if fmt == "sentence-transformers":
        check_sentence_transformers(retriever)
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for name, tower in (("query", retriever.query), ("document", retriever.doc)):
            _write_tower(tower, retriever, tmp / name, fmt=fmt, max_len=retriever.cfg.query_max_len if name == "query"
                         else retriever.cfg.block_max_len)
    return {"kind": "retriever", "source": str(found), "format": fmt, "out": str(out),
            "parts": {"query": str(out / "query"), "document": str(out / "document")}}


def _export_reader(found: Path, out: Path, fmt: str) -> dict:
    from safetensors.torch import save_file

    from ralm.models.reader import Reader

    if fmt == "package":
        return _package_reader(found, out)
    if fmt != "hf":
        raise RalmError("a span reader has no sentence-transformers form; export it with --format hf")
    reader = Reader.from_pretrained(found)
    check_finite(reader, str(found))
    if reader.cfg.trainable_layers is not None:
        reader.cfg.trainable_layers = None  # the exported encoder is whole
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        _write_bert(reader.bert, reader.tokenizer, tmp, encoder_config=reader.cfg.encoder)
        save_file({k: v.detach().float().contiguous() for k, v in reader.spans.state_dict().items()}, str(tmp / "span_scorer.safetensors"))
        config = {k: v for k, v in reader.cfg.__dict__.items() if k not in ("encoder", "base_model")}
        (tmp / "ralm_reader.json").write_text(json.dumps({"format": "ralm.reader/1", **config}, indent=2) + "\n")
    return {"kind": "reader", "source": str(found), "format": fmt, "out": str(out), "parts": {"reader": str(out)}}


def _package_reader(found: Path, out: Path) -> dict:
    """The reader's tensors in fp16, word embeddings in one shard and the rest in another, every
    other file of its directory copied: the form of the package's reader."""
    from safetensors.torch import save_file

    from ralm.atomic import read_weights

    state = read_weights(found)
    if any(not v.is_floating_point() or not v.isfinite().all() for v in state.values()):
        raise RalmError(f"{found}: weights that are not finite floating-point tensors cannot be packed")
    embeddings = sorted(k for k in state if "word_embeddings" in k)
    shards = [embeddings, sorted(k for k in state if k not in embeddings)]
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for i, keys in enumerate(shards, 1):
            save_file({k: state[k].half().contiguous() for k in keys}, str(tmp / f"model-{i:05d}-of-{len(shards):05d}.safetensors"),
                      metadata={"format": "ralm.reader/1"})
        for f in found.iterdir():
            if f.is_file() and not (f.name.startswith("model") and f.name.endswith(".safetensors")):
                (tmp / f.name).write_bytes(f.read_bytes())
        stale = _maps_of_another_reader(tmp)
    result = {"kind": "reader", "source": str(found), "format": "package", "out": str(out), "parts": {"reader": str(out)}}
    if stale:
        note = (f"the {', '.join(stale)} confidence map(s) were fitted with the fp32 weights; the fp16 package is another "
                f"reader to them (they would warn on every answer): calibrate the package itself, `ralm eval qa --model {out} "
                "--calibrate --out DIR ...`")
        warnings.warn(RalmWarning(note), stacklevel=2)
        result["notes"] = [note]
    return result


def _maps_of_another_reader(packed: Path) -> list[str]:
    """The index kinds whose confidence map in the packed reader's config records another
    reader's fingerprint than the packed weights have (rounding to fp16 changes it)."""
    from ralm.models.confidence import Calibrations, fitted_with_another_reader
    from ralm.models.reader import Reader

    calibration = json.loads((packed / "config.json").read_text()).get("calibration")
    if calibration is None:  # nothing to check: the weights need not be loaded
        return []
    fingerprint = Reader.from_pretrained(packed).fingerprint()
    maps = Calibrations.from_json(calibration, str(packed / "config.json")).by_kind
    return sorted(kind for kind, cal in maps.items() if fitted_with_another_reader(cal, fingerprint))


def check_sentence_transformers(retriever: Retriever) -> None:
    """sentence-transformers pools [CLS] or the mean, then Normalize and Dense: HF-REALM's tanh
    pooler, projection LayerNorm and segment ids have no module there."""
    cfg = retriever.cfg
    if cfg.pooling == "pooler" or cfg.proj_layernorm or cfg.pair_sep_id is not None:
        raise RalmError("this retriever (HF-REALM style: tanh pooler, projection LayerNorm, segment ids) has no "
                        "sentence-transformers form; export it with --format hf")


def _write_bert(bert, tokenizer, path: Path, encoder_config: dict) -> None:
    """A plain Hugging Face BertModel directory: config.json, model.safetensors, tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in bert.state_dict().items() if not k.endswith("position_ids")}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in encoder_config.items() if not k.startswith("_")}
    config.setdefault("architectures", ["BertModel"])
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(path))


def _write_tower(tower: Tower, retriever: Retriever, path: Path, *, fmt: str, max_len: int) -> None:
    from safetensors.torch import save_file

    cfg = retriever.cfg
    _write_bert(tower.bert, retriever.tokenizer, path, encoder_config=cfg.encoder)
    proj = tower.proj.state_dict() if cfg.dim is not None else {}
    if fmt == "hf":
        head = {"pooling": cfg.pooling, "normalize": cfg.normalize, "projection": bool(proj),
                "projection_layernorm": cfg.proj_layernorm, "pair_sep_id": cfg.pair_sep_id, "max_length": max_len,
                "score_scale": tower.scale}
        if proj:
            save_file({**{k: v.detach().float().contiguous() for k, v in proj.items()},
                       **{f"layernorm.{k}": v.detach().float().contiguous() for k, v in tower.norm.state_dict().items()}},
                      str(path / "ralm_head.safetensors"))
        (path / "ralm_head.json").write_text(json.dumps(head, indent=2) + "\n")
        return
    hidden = tower.bert.config.hidden_size
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": cfg.pooling == "cls",
               "pooling_mode_mean_tokens": cfg.pooling == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": False, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    if cfg.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    if proj:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (path / "3_Dense").mkdir()
        dense = {"in_features": hidden, "out_features": cfg.dim, "bias": True,
                 "activation_function": "torch.nn.modules.linear.Identity"}
        (path / "3_Dense" / "config.json").write_text(json.dumps(dense, indent=2) + "\n")
        save_file({f"linear.{k}": v.detach().float().contiguous() for k, v in proj.items()}, str(path / "3_Dense" / "model.safetensors"))
    (path / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}) + "\n")
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"similarity_fn_name": "dot", "ralm_score_scale": tower.scale}, indent=2) + "\n")
