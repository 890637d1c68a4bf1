"""Retrieval: the retriever's towers, exact / faiss / BM25 indexes, versioned index directories, refresh."""
