"""Encoders: ralm's own BERT, loading Hugging Face encoders, tokenizers and checkpoint weights,
and encoding rows in groups of similar length; below both retrieval (the towers) and models (the
reader, REALM's encoder), which build on them."""
