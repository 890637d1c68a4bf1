"""The query side: a searcher over an index directory's latest version, score fusion across its
sides, and live document updates (overlay + crash-safe update log)."""
