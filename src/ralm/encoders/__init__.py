"""Encoders: ralm's own BERT, loading Hugging Face encoders, tokenizers and checkpoint weights,
and padding token rows into batches; below both retrieval (the towers) and models (the reader,
REALM's encoder), which build on them."""
