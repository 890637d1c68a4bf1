"""Search structures over one side of an index: exact MIPS in torch (one process or sharded
under torchrun), approximate MIPS with faiss, and BM25 (bm25s)."""
