"""Data: corpora, REALM blocks in a memory-mapped token store, masking, QA files."""
