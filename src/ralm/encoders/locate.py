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
HUB_TIMEOUT_S = 5.0


def offline() -> bool:
    """Hugging Face's offline switches, read as transformers reads them."""
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached(name: str) -> bool:
    from huggingface_hub import constants  # light: no torch, no transformers

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    return (Path(cache) / f"models--{name.replace('/', '--')}").is_dir()


def check_model_location(name: str | os.PathLike, option: str = "--model", *, hub: bool = True, weights: bool = True) -> None:
    """Refuse a model that cannot load, naming `option`: a path that does not exist (or, with
    `hub`, a name that is no hub name, one missing from the cache while offline, or, online, one the
    hub does not hold or cannot be asked about), a file, or,
    with `weights` (off: only its tokenizer is read), a directory whose only weights are pickled."""
    text = str(name)
    path = Path(text).expanduser()
    if not path.exists():
        if not hub or not _HUB_NAME.match(text):
            raise RalmError(f"{option}: no such directory: {text}")
        if _cached(text):
            return
        if offline():
            raise RalmError(f"{option} {text}: no such directory, nor (offline: HF_HUB_OFFLINE is set) a hub model in the "
                            "local cache")
        _check_hub(text, option)
        return  # a hub model: the loader downloads it
    if not path.is_dir():
        raise RalmError(f"{option} {text} is a file; name a model directory (or a run)")
    if weights:
        check_weights_format(path, option)


def _check_hub(name: str, option: str) -> None:
    """A name that is no directory, looked up on the hub once, without retries: a typo is named in
    a second, where the loader would retry an unreachable hub for most of a minute."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; the loader says what access it needs
    except RepositoryNotFoundError:
        raise RalmError(f"{option} {name}: no such directory, nor a model on the Hugging Face hub") from None
    except HfHubHTTPError:
        return  # the hub answered (a private model, a server error): the loader names it
    except Exception as e:  # no network: the hub cannot tell
        raise RalmError(f"{option} {name}: no such directory, and the Hugging Face hub, where it would be a model's name, "
                        f"cannot be reached ({type(e).__name__}); name a local model directory") from None


def check_weights_format(path: Path, option: str = "--model") -> None:
    """ralm reads weights from safetensors only: unpickling pytorch_model.bin can run code."""
    pickled = [w for w in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (path / w).is_file()]
    safe = (path / "model.safetensors").is_file() or any(path.glob("model*.safetensors"))
    if pickled and not safe:
        raise RalmError(f"{option} {path} holds pickled weights ({pickled[0]}); ralm loads safetensors only (unpickling "
                        "can run code). Convert them once: load the model in transformers (e.g. "
                        f"AutoModel.from_pretrained('{path}')) and .save_pretrained('NEW_DIR', safe_serialization=True), "
                        "its tokenizer saved beside it")
