"""The BERT towers: loading encoders and tokenizers, the retriever's query and document towers
with their projection, and batched encoding of token rows."""
