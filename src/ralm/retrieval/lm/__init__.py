"""Retrieval stores of the language-model siblings: RETRO's chunk database and kNN-LM's datastore."""
