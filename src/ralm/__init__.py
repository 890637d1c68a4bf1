"""ralm: retrieval-augmented language models (REALM, RETRO, kNN-LM, DPR, BM25) on your corpus.

The public API is what this module exports; everything else may change. Names are imported
on first use, so `import ralm` stays light (no torch, no transformers).
"""

from importlib import import_module

__version__ = "0.3.0"

_EXPORTS = {
    "RalmError": "ralm.errors",
    "read_corpus": "ralm.data.corpus",
    "read_questions": "ralm.data.qa",
    "BlockStore": "ralm.data.blocks",
    "Retriever": "ralm.retrieval.encoders",
    "build_index": "ralm.retrieval.build",
    "Searcher": "ralm.retrieval.searcher",
    "IndexDir": "ralm.retrieval.store",
    "ExactIndex": "ralm.retrieval.exact",
    "FaissIndex": "ralm.retrieval.faiss_index",
    "BM25Index": "ralm.retrieval.bm25",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ralm' has no attribute {name!r}")
