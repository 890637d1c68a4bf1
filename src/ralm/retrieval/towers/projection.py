"""A fresh projection starts as PCA of the document vectors, so an untrained retriever already
ranks as its encoder does and scores on a useful scale (SCORE_SCALE).

Shapes: N documents, H BERT hidden size, D retrieval dim.
"""

from __future__ import annotations

import numpy as np
import torch

from ralm.data.blocks import BlockStore
from ralm.retrieval.towers.encoders import Retriever, SCORE_SCALE
from ralm.retrieval.towers.encoding import encode_rows
from ralm.runtime import Runtime


def init_projection_pca(retriever: Retriever, pooled_docs: torch.Tensor) -> None:
    """Set both towers' projection to the top-`dim` right singular vectors of the pooled
    document vectors [N, H] (uncentred: that best preserves inner products), scaled so that a
    projected document has a mean squared norm of SCORE_SCALE."""
    cfg = retriever.cfg
    if cfg.dim is None:
        cfg.projection_ready = True
        return
    x = pooled_docs.float()
    _, _, vt = torch.linalg.svd(x, full_matrices=True)  # vt [H, H]: a full orthonormal basis
    w = vt[: cfg.dim]  # [D, H]
    energy = (x @ w.T).square().sum(-1).mean()  # mean squared norm of the projected documents
    w = w * (SCORE_SCALE / energy.clamp_min(1e-12)).sqrt()
    for tower in (retriever.query, retriever.doc):
        with torch.no_grad():
            tower.proj.weight.copy_(w)
            tower.proj.bias.zero_()
    cfg.projection_ready = True


def init_projection(retriever: Retriever, blocks: BlockStore, *, runtime: Runtime, sample: int = 4096,
                    batch_size: int = 64, seed: int = 0, show_progress: bool = True) -> torch.Tensor | None:
    """PCA-initialise a fresh projection from the pooled vectors of a sample of blocks, encoded
    under `runtime` (the retriever already on its device).

    Returns the pooled vectors [N, H] when the sample was the whole corpus, so the caller can
    project them instead of encoding every block a second time."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(len(blocks), size=min(sample, len(blocks)), replace=False))
    hidden = retriever.doc.bert.config.hidden_size
    pooled = np.zeros((len(rows), hidden), dtype=np.float32)
    encode_rows(retriever.doc.pooled, [blocks.tokens[int(i)] for i in rows], blocks.tokens.lengths()[rows], out=pooled,
                batch_size=batch_size, runtime=runtime, pad_id=retriever.tokenizer.pad_token_id or 0, show_progress=show_progress,
                description="projection (PCA)")
    init_projection_pca(retriever, torch.from_numpy(pooled))
    return torch.from_numpy(pooled) if len(rows) == len(blocks) else None
