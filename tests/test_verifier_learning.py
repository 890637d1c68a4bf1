"""The answer verifier learns what a relation-swapped question asks (train/reader.py `verify`,
data/negatives.py `relation_swap`): trained on facilities that state when they opened (and some
when they were renovated), on held-out facilities it rejects the opening year given for "when
did it renovate?" where only the opening is stated, and accepts it where the renovation is.
Asked of the same context, only the question's relation differs, so no word of the question
alone tells the cases apart. The break it guards: without relation swaps in training the
verifier has never seen the case and does not tell them apart (measured, see the test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ralm.models.reader import Reader
from ralm.train.reader import ReaderTrainConfig, train_reader

NAMES = ["Ash", "Birch", "Cedar", "Dale", "Elm", "Fern", "Glen", "Heath", "Iris", "Juniper", "Kestrel", "Larch", "Maple",
         "Nettle", "Oak", "Poplar", "Quince", "Rowan", "Sorrel", "Thorn", "Umber", "Vale", "Willow", "Yarrow", "Alder",
         "Bramble", "Clover", "Dunlin", "Egret", "Finch", "Gorse", "Holly", "Ivy", "Jay", "Kite", "Linnet", "Moss", "Newt"]


def _facilities(seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(NAMES):
        opened, renovated = int(rng.integers(1900, 1960)), int(rng.integers(1970, 2020))
        both = i % 2 == 0
        text = f"{name} Library opened in {opened}." + (f" It was renovated in {renovated}." if both else " It lends books.")
        out.append({"id": f"f{i}", "title": f"{name} Library", "text": text, "opened": str(opened),
                    "renovated": str(renovated) if both else None})
    return out


@pytest.mark.slow
def test_the_verifier_rejects_a_relation_swapped_answer_the_reader_gives(tiny_bert, tmp_path):
    docs = _facilities(0)
    train, held = docs[:30], docs[30:]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({k: d[k] for k in ("id", "title", "text")}) + "\n" for d in docs))
    questions = []
    for d in train:
        questions.append({"id": d["id"] + "o", "question": f"When did {d['title']} open?", "answers": [d["opened"]], "doc_id": d["id"]})
        if d["renovated"]:
            questions.append({"id": d["id"] + "r", "question": f"When did {d['title']} renovate?", "answers": [d["renovated"]],
                              "doc_id": d["id"]})
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    cfg = ReaderTrainConfig(questions=str(tmp_path / "q.jsonl"), corpus=str(tmp_path / "corpus.jsonl"), init=str(tiny_bert),
                            relation_swap_share=0.5, verify=True, steps=300, batch_size=8, lr=2e-3, warmup=20, max_len=96,
                            stride=16, save_every=300, log_every=50, dtype="fp32")
    train_reader(cfg, tmp_path / "run", show_progress=False)
    reader = Reader.from_pretrained(tmp_path / "run" / "final" / "reader").eval()

    def p_verify(question: str, answer: str, d: dict) -> float:
        batch = reader.featurizer.featurize_verify([question], [answer], [d["text"]], titles=[d["title"]])
        with torch.no_grad():
            return torch.sigmoid(reader.verify(batch)).item()

    only_opened = [d for d in held if not d["renovated"]]
    swapped = [p_verify(f"When did {d['title']} renovate?", d["opened"], d) for d in only_opened]  # what the reader would give
    asked = [p_verify(f"When did {d['title']} open?", d["opened"], d) for d in held]
    stated = [p_verify(f"When did {d['title']} renovate?", d["renovated"], d) for d in held if d["renovated"]]
    assert max(swapped) < 0.5 < min(asked), (swapped, asked)
    # "renovate" is not rejected for its word: where the renovation is stated, its year scores well above the swap's
    assert np.mean(stated) > np.mean(swapped) + 0.2, (stated, swapped)
