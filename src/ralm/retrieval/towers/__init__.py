"""The retriever's towers: its query and document towers with their projection, and batched
encoding of token rows (the BERT inside them and its loading are ralm.encoders)."""
