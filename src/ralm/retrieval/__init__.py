"""Retrieval: BERT towers, exact / faiss / BM25 indexes, versioned index directories, refresh."""
