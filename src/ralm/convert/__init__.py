"""Conversion: checkpoints saved by other libraries into ralm's own (Hugging Face REALM)."""
