"""Where a model named by the user is: a local directory (a model, a run) or a Hugging Face hub
name. Only a few stat calls and no torch, so the CLI names a wrong --model in about a second,
before anything heavy is imported; the loaders (encoders/loading.py) check the same way."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ralm.errors import RalmError

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "bert-base-uncased", "org/name"
_TRUE = ("1", "on", "yes", "true")


def offline() -> bool:
    """Hugging Face's offline switches, read as transformers reads them."""
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached(name: str) -> bool:
    from huggingface_hub import constants  # light: no torch, no transformers

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    return (Path(cache) / f"models--{name.replace('/', '--')}").is_dir()


def check_model_location(name: str | os.PathLike, option: str = "--model", *, hub: bool = True, weights: bool = True) -> None:
    """Refuse a model that cannot load, naming `option`: a path that does not exist (or, with
    `hub`, a name that is no hub name, or one missing from the cache while offline), a file, or,
    with `weights` (off: only its tokenizer is read), a directory whose only weights are pickled."""
    text = str(name)
    path = Path(text).expanduser()
    if not path.exists():
        if not hub or not _HUB_NAME.match(text):
            raise RalmError(f"{option}: no such directory: {text}")
        if offline() and not _cached(text):
            raise RalmError(f"{option} {text}: no such directory, nor (offline: HF_HUB_OFFLINE is set) a hub model in the "
                            "local cache")
        return  # a hub name: the loader downloads it, or names what went wrong
    if not path.is_dir():
        raise RalmError(f"{option} {text} is a file; name a model directory (or a run)")
    if weights:
        check_weights_format(path, option)


def check_weights_format(path: Path, option: str = "--model") -> None:
    """ralm reads weights from safetensors only: unpickling pytorch_model.bin can run code."""
    pickled = [w for w in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (path / w).is_file()]
    safe = (path / "model.safetensors").is_file() or any(path.glob("model*.safetensors"))
    if pickled and not safe:
        raise RalmError(f"{option} {path} holds pickled weights ({pickled[0]}); ralm loads safetensors only (unpickling "
                        "can run code). Convert them once: load the model in transformers (e.g. "
                        f"AutoModel.from_pretrained('{path}')) and .save_pretrained('NEW_DIR', safe_serialization=True), "
                        "its tokenizer saved beside it")
