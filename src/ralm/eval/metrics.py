"""Metrics as plain functions over plain values."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ralm.data.qa import normalize_answer


def recall_at_k(hit_lists: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float]:
    """Share of questions with an answer-bearing passage among the first k (as a percentage)."""
    n = len(hit_lists)
    return {f"recall@{k}": 100.0 * sum(any(h[:k]) for h in hit_lists) / max(n, 1) for k in ks}


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    """SQuAD v1.1 exact match: 1.0 when the normalised prediction equals a normalised gold
    answer (the max over gold answers), else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in gold))


def f1(prediction: str, gold: Sequence[str]) -> float:
    """SQuAD v1.1 token F1 (bag of normalised words), the max over gold answers."""
    return max((_token_f1(normalize_answer(prediction).split(), normalize_answer(g).split()) for g in gold), default=0.0)


def _token_f1(pred: list[str], gold: list[str]) -> float:
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)
