"""A wordpiece tokenizer read straight from a model directory's tokenizer.json, with the calls
ralm makes of a Hugging Face fast tokenizer (`tok(texts[, pairs], padding=True, truncation=True,
max_length=..., return_tensors="pt")`, the special-token ids, `get_vocab`, `decode`,
`save_pretrained`).

Both run the same Rust `tokenizers` pipeline (transformers' fast tokenizer sets truncation and
padding on it and calls `encode_batch`), so the ids are the same; this one loads without
importing transformers, which costs more than torch itself on a one-shot `ralm ask`
(benchmarks/cli/cli_latency.py). tests/test_bert.py checks it against transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from ralm.atomic import damaged_file, read_json
from ralm.errors import RalmError

FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL = ("cls", "sep", "pad", "mask", "unk")


class WordpieceTokenizer:
    def __init__(self, backend: Tokenizer, config: dict, source: Path | None = None):
        self.backend_tokenizer = backend
        self.config = config
        self.source = source
        self.model_max_length = int(config.get("model_max_length", 512))
        for name in SPECIAL:
            token = config.get(f"{name}_token")
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", backend.token_to_id(token) if isinstance(token, str) else None)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=False)

    is_fast = True

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "WordpieceTokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise RalmError(f"{path}: no tokenizer.json")
        config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        try:
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust library raises a bare Exception for a damaged file
            raise damaged_file([path / "tokenizer.json"], e) from None
        return cls(backend, config, path)

    def __repr__(self) -> str:
        return f"WordpieceTokenizer(vocab={self.vocab_size}, max_length={self.model_max_length}, source={str(self.source)!r})"

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *, padding: bool = False,
                 truncation: bool = False, max_length: int | None = None, return_tensors: str | None = None,
                 add_special_tokens: bool = True, split_special_tokens: bool = False) -> dict:
        """input_ids, token_type_ids and attention_mask of each text (or (text, pair)), as
        transformers gives them: truncation longest-first, padding to the longest in the batch;
        with `split_special_tokens`, "[SEP]" typed in a text is its wordpieces, not the separator."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        pairs = None if text_pair is None else ([text_pair] if isinstance(text_pair, str) else list(text_pair))
        tok = self.backend_tokenizer
        if truncation:
            tok.enable_truncation(max_length or self.model_max_length, strategy="longest_first")
        else:
            tok.no_truncation()
        if padding:
            tok.enable_padding(pad_id=self.pad_token_id or 0, pad_token=self.pad_token or "[PAD]")
        else:
            tok.no_padding()
        tok.encode_special_tokens = split_special_tokens
        inputs = texts if pairs is None else list(zip(texts, pairs))
        encs = tok.encode_batch(inputs, add_special_tokens=add_special_tokens)
        out = {"input_ids": [e.ids for e in encs], "token_type_ids": [e.type_ids for e in encs],
               "attention_mask": [e.attention_mask for e in encs]}
        if return_tensors == "pt":
            import torch

            return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        if return_tensors is not None:
            raise RalmError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        return {k: v[0] for k, v in out.items()} if single else out

    def save_pretrained(self, out: str | os.PathLike) -> None:
        """tokenizer.json and tokenizer_config.json, as read (transformers loads them back)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if self.source is not None and (self.source / "tokenizer.json").is_file():
            shutil.copyfile(self.source / "tokenizer.json", out / "tokenizer.json")
        else:
            self.backend_tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
