"""ralm: retrieval-augmented language models (REALM, RETRO, kNN-LM, DPR, BM25) on your corpus.

The public API is what this module exports; everything else may change. Names are imported
on first use, so `import ralm` stays light (no torch, no transformers). docs/python-api.md
shows them in use.
"""

from importlib import import_module

__version__ = "0.4.0"

_EXPORTS = {
    "RalmError": "ralm.errors",
    "Runtime": "ralm.runtime",  # device, compute dtype, progress: every entry point's `runtime=`
    # data: documents and question files
    "Document": "ralm.data.corpus",
    "read_corpus": "ralm.data.corpus",
    "Question": "ralm.data.qa",
    "read_questions": "ralm.data.qa",
    "BlockStore": "ralm.data.blocks",
    # retrieval: encode, index, search
    "Retriever": "ralm.retrieval.towers.encoders",
    "build_index": "ralm.retrieval.index.build",
    "upgrade_index": "ralm.retrieval.index.build",
    "compact_index": "ralm.retrieval.search.compaction",
    "Searcher": "ralm.retrieval.search.searcher",
    "LiveSearcher": "ralm.retrieval.search.live",
    "Hit": "ralm.retrieval.search.searcher",
    "QueryConfig": "ralm.retrieval.search.query",  # k, side(s), fusion, min_confidence: what a query asks
    "IndexDir": "ralm.retrieval.index.store",
    "ExactIndex": "ralm.retrieval.backends.exact",
    "FaissIndex": "ralm.retrieval.backends.faiss_index",
    "BM25Index": "ralm.retrieval.backends.bm25",
    # reading and answering
    "Reader": "ralm.models.reader",
    "OpenQA": "ralm.pipeline",
    "Answer": "ralm.pipeline",
    "Evidence": "ralm.pipeline",
    "open_searcher": "ralm.pipeline",
    "resolve_reader": "ralm.pipeline",
    # evaluation
    "evaluate_retrieval": "ralm.eval.retrieval",
    "evaluate_qa": "ralm.eval.openqa",
    # trainers: one config dataclass and one function each, returning a typed result
    "TrainResult": "ralm.train.loop", "TrainingInterrupted": "ralm.train.loop", "with_preset": "ralm.configs",
    "LoopConfig": "ralm.train.loop", "Trainer": "ralm.train.trainer",  # to write a trainer (docs/usage.md)
    "IctConfig": "ralm.train.ict", "train_ict": "ralm.train.ict",
    "MlmConfig": "ralm.train.mlm", "warm_up_encoder": "ralm.train.mlm",
    "PretrainConfig": "ralm.train.pretrain", "pretrain": "ralm.train.pretrain",
    "ReaderTrainConfig": "ralm.train.reader", "train_reader": "ralm.train.reader",
    "FinetuneConfig": "ralm.train.finetune", "finetune": "ralm.train.finetune",
    "DPRConfig": "ralm.train.dpr", "train_dpr": "ralm.train.dpr",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ralm' has no attribute {name!r}")
