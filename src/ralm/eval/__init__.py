"""Evaluation: metrics, retrieval recall, open-domain QA, perplexity."""
