"""Numerical compatibility of `ralm convert hf-realm` with Hugging Face REALM (transformers 4.x).

Two stages, one per environment (transformers 5 removed REALM, so the reference runs in a
separate venv that has transformers==4.57.6):

  hf    (transformers 4.x venv): build tiny randomly initialised RealmScorer (separate query
        embedder), RealmEmbedder, RealmKnowledgeAugEncoder, RealmReader and RealmForOpenQA
        models, perturb every weight (so LayerNorms and biases are not at their identity
        init), save them with `save_pretrained`, run them on fixed inputs and save inputs and
        outputs (inputs.npz, outputs.npz). Candidate blocks are RealmTokenizer's pair encoding
        of (title, body) (`batch_encode_candidates`), segment id 1 on the body.
  ralm  (our venv): convert every saved model with ralm.convert.hf_realm, run our modules on
        the same inputs and compare: our block featurisation of the same (title, body) texts
        (equal ids), relevance scores with our document tower fed ids and mask only, as the
        index builder feeds it (max abs diff <= 1e-4), the marginal MLM loss of the
        knowledge-augmented encoder (<= 1e-4), the reader's span logits and its predicted span
        (equal). Exits 1 when a check fails.

Run both (the default stage shells out to the other venv for the first):
  python benchmarks/interop/hf_realm_compat.py --work /tmp/hf-realm-compat --hf-python /tmp/venv-hf4/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOL = 1e-4
# B questions, K candidates per question (= num_candidates = reader_beam_size).
B, K = 2, 3
SHARED = dict(num_candidates=K, reader_beam_size=K, searcher_beam_size=K, num_block_records=8, hidden_act="gelu_new",
              max_position_embeddings=512)
# Noise added to weight matrices: large enough that e.g. gelu vs gelu_new shows above the
# tolerance in the tiny models; at BERT-base size that much saturates BERT and ties all span
# logits, so there it is the initialiser's own scale.
PERTURB = {"tiny": 0.1, "base": 0.02}
PRESETS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, retriever_proj_size=16,
                 span_hidden_size=24, max_span_width=4, reader_seq_len=32, **SHARED),
    # the released REALM/ORQA sizes (BERT-base, 128-d retrieval, 256-d span MLP, spans of <= 10)
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, retriever_proj_size=128,
                 span_hidden_size=256, max_span_width=10, reader_seq_len=320, **SHARED),
}
CLS, SEP, MASK, PAD = 101, 102, 103, 0
# B x K candidate blocks (title, body): encoded by HF as text pairs, by us as REALM blocks.
CANDIDATES = [[("Paris", "Paris is the capital of France. It lies on the Seine river."),
               ("Tokyo", "Tokyo is the capital of Japan."),
               ("Nile", "The Nile is a long river in Africa. It flows north into the Mediterranean Sea.")],
              [("Mount Everest", "Mount Everest is the highest mountain above sea level."),
               ("Python (language)", "Python is a programming language created by Guido van Rossum."),
               ("Moon", "Neil Armstrong walked on the Moon in 1969.")]]
BLOCK_LEN = 24  # >= the longest candidate, so no block is cut


# -- inputs shared by both stages -------------------------------------------------------------

def make_inputs(seed: int) -> dict[str, np.ndarray]:
    """Token ids drawn from ordinary wordpieces, with [CLS]/[SEP] structure and right padding."""
    rng = np.random.default_rng(seed)
    words = lambda n: rng.integers(1000, 30000, size=n)  # noqa: E731

    def rows(lengths, width):
        ids = np.full((len(lengths), width), PAD, np.int64)
        mask = np.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, :n] = [CLS, *words(n - 2), SEP]
            mask[i, :n] = 1
        return ids, mask

    q_ids, q_mask = rows([9, 6], 9)  # [B, Lq]
    # Knowledge-augmented encoder: [CLS] x [SEP] z [SEP] per candidate, x shared by the K.
    L = 16
    ka_ids = np.full((B, K, L), PAD, np.int64)
    ka_types = np.zeros_like(ka_ids)
    ka_mask = np.zeros_like(ka_ids)
    labels = np.full((B, L), -100, np.int64)
    mlm_mask = np.zeros((B, L), np.int64)
    for b, (x_len, masked) in enumerate([(6, [1, 4]), (5, [2])]):
        x = words(x_len)
        for j, p in enumerate(masked):
            labels[b, 1 + p] = x[p]
            mlm_mask[b, 1 + p] = 1
            x[p] = MASK
        for k in range(K):
            z = words(int(rng.integers(3, L - x_len - 3 + 1)))
            seq = [CLS, *x, SEP, *z, SEP]
            ka_ids[b, k, : len(seq)] = seq
            ka_types[b, k, x_len + 2 : len(seq)] = 1
            ka_mask[b, k, : len(seq)] = 1
    # Reader: K inputs [CLS] q [SEP] z [SEP], spans allowed inside z only (HF's block_mask).
    R = 20
    r_ids = np.full((K, R), PAD, np.int64)
    r_types = np.zeros_like(r_ids)
    r_mask = np.zeros_like(r_ids)
    ev_start, ev_end = np.zeros(K, np.int64), np.zeros(K, np.int64)
    q = words(5)
    for k, z_len in enumerate([12, 8, 10]):
        seq = [CLS, *q, SEP, *words(z_len), SEP]
        r_ids[k, : len(seq)] = seq
        r_types[k, len(q) + 2 : len(seq)] = 1
        r_mask[k, : len(seq)] = 1
        ev_start[k], ev_end[k] = len(q) + 2, len(seq) - 1
    block_mask = (r_types == 1) & (r_ids != SEP) & (r_mask == 1)
    return dict(q_ids=q_ids, q_mask=q_mask,
                ka_ids=ka_ids, ka_types=ka_types, ka_mask=ka_mask, ka_relevance=rng.normal(size=(B, K)).astype(np.float32),
                labels=labels, mlm_mask=mlm_mask, r_ids=r_ids, r_types=r_types, r_mask=r_mask, block_mask=block_mask,
                r_relevance=rng.normal(size=K).astype(np.float32), ev_start=ev_start, ev_end=ev_end)


# -- stage hf: transformers 4.x ----------------------------------------------------------------

def stage_hf(work: Path, vocab: Path, seed: int, preset: str) -> None:
    import torch
    import transformers
    from transformers import (RealmConfig, RealmEmbedder, RealmForOpenQA, RealmKnowledgeAugEncoder, RealmReader,
                              RealmScorer, RealmTokenizerFast)

    torch.manual_seed(seed)
    tok = RealmTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    cfg = RealmConfig(vocab_size=tok.vocab_size, **PRESETS[preset])

    def perturbed(model):
        """Move every weight off its initialisation (LayerNorms off 1/0, biases off 0)."""
        with torch.no_grad():
            for p in model.parameters():
                p.add_((PERTURB[preset] if p.dim() > 1 else 0.1) * torch.randn_like(p))
        return model.eval()

    def save(model, name, safe=True):
        model.save_pretrained(str(work / name), safe_serialization=safe)
        tok.save_pretrained(str(work / name))

    titles, bodies = ([[c[i] for c in row] for row in CANDIDATES] for i in (0, 1))
    pairs = tok.batch_encode_candidates(titles, text_pair=bodies, max_length=BLOCK_LEN, return_tensors="np")
    inputs = make_inputs(seed) | {"d_ids": pairs["input_ids"], "d_mask": pairs["attention_mask"], "d_types": pairs["token_type_ids"]}
    x = {k: torch.from_numpy(v) for k, v in inputs.items()}
    outputs = {}
    with torch.no_grad():
        scorer = perturbed(RealmScorer(cfg, query_embedder=RealmEmbedder(cfg)))
        s = scorer(input_ids=x["q_ids"], attention_mask=x["q_mask"], candidate_input_ids=x["d_ids"],
                   candidate_attention_mask=x["d_mask"], candidate_token_type_ids=x["d_types"])
        outputs |= dict(relevance=s.relevance_score, query_score=s.query_score, candidate_score=s.candidate_score)
        save(scorer, "scorer")
        save(scorer.embedder, "embedder")  # one embedder alone: both towers share it
        outputs["embedder_query"] = scorer.embedder(input_ids=x["q_ids"], attention_mask=x["q_mask"]).projected_score

        encoder = perturbed(RealmKnowledgeAugEncoder(cfg))
        e = encoder(input_ids=x["ka_ids"], attention_mask=x["ka_mask"], token_type_ids=x["ka_types"],
                    relevance_score=x["ka_relevance"], labels=x["labels"], mlm_mask=x["mlm_mask"])
        outputs["mlm_loss"] = e.loss
        save(encoder, "encoder")

        for name, model in (("reader", perturbed(RealmReader(cfg))), ("openqa", perturbed(RealmForOpenQA(cfg)))):
            reader = model if name == "reader" else model.reader
            h = reader.realm(x["r_ids"], attention_mask=x["r_mask"], token_type_ids=x["r_types"]).last_hidden_state
            logits, starts, ends = reader.qa_outputs(h, x["block_mask"])  # [K, spans], [spans], [spans]
            r = reader(input_ids=x["r_ids"], attention_mask=x["r_mask"], token_type_ids=x["r_types"],
                       relevance_score=x["r_relevance"], block_mask=x["block_mask"])
            outputs |= {f"{name}_logits": logits, f"{name}_starts": starts, f"{name}_ends": ends,
                        f"{name}_predicted": torch.stack([r.block_idx, r.start_pos.squeeze(), r.end_pos.squeeze()])}
            save(model, name, safe=False)  # HF cannot write readers as safetensors (shared MLM-head bias)
        outputs["openqa_query"] = model.embedder(input_ids=x["q_ids"], attention_mask=x["q_mask"]).projected_score
    np.savez(work / "inputs.npz", **inputs)
    np.savez(work / "outputs.npz", **{k: v.numpy() for k, v in outputs.items()})
    (work / "hf.json").write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                              "preset": preset, "perturb": PERTURB[preset], "config": PRESETS[preset], "seed": seed}, indent=2) + "\n")


# -- stage ralm: convert and compare -----------------------------------------------------------

def stage_ralm(work: Path) -> dict:
    import torch
    from einops import rearrange

    from ralm.data.blocks import iter_blocks
    from ralm.data.corpus import Document
    from ralm.convert.hf_realm import convert_hf_realm
    from ralm.data.reader_features import ReaderBatch, valid_spans
    from ralm.models.reader import Reader, best_spans
    from ralm.models.realm import KnowledgeAugmentedEncoder, marginal_nll, masked_token_log_probs
    from ralm.retrieval.towers.encoders import Retriever

    torch.set_grad_enabled(False)
    x = {k: torch.from_numpy(v) for k, v in np.load(work / "inputs.npz", allow_pickle=False).items()}
    ref = {k: torch.from_numpy(v) for k, v in np.load(work / "outputs.npz", allow_pickle=False).items()}
    runs = work / "converted"
    for name in ("scorer", "embedder", "encoder", "reader", "openqa"):
        convert_hf_realm(work / name, runs / name)
    result: dict = {"tolerance": TOL}

    def diff(a, b) -> float:
        return float((a.float() - b.float()).abs().max())

    # Retriever: relevance <query(x), doc(z)> of the scorer (separate towers). The document
    # tower gets our blocks of the candidate texts, ids and mask only.
    ret = Retriever.from_pretrained(runs / "scorer" / "final" / "retriever").eval()
    docs = [Document(f"c{i}", title, body) for i, (title, body) in enumerate(c for row in CANDIDATES for c in row)]
    blocks = [b.token_ids for _, per_doc in iter_blocks(docs, ret.tokenizer) for b in per_doc]
    hf_blocks = [row[row_mask.bool()].tolist() for row, row_mask in zip(x["d_ids"].flatten(0, 1), x["d_mask"].flatten(0, 1))]
    result["blocks_equal_pair_encoding"] = blocks == hf_blocks
    q = ret.query(x["q_ids"], x["q_mask"])  # [B, D]
    d = rearrange(ret.doc(x["d_ids"].flatten(0, 1), x["d_mask"].flatten(0, 1)), "(b k) d -> b k d", b=B)  # [B, K, D]
    result["relevance_max_abs_diff"] = diff(torch.einsum("bd,bkd->bk", q, d), ref["relevance"])
    result["query_embedding_max_abs_diff"] = diff(q, ref["query_score"])
    emb = Retriever.from_pretrained(runs / "embedder" / "final" / "retriever").eval()
    result["embedder_max_abs_diff"] = max(diff(emb.query(x["q_ids"], x["q_mask"]), ref["embedder_query"]),
                                          diff(emb.doc(x["q_ids"], x["q_mask"]), ref["embedder_query"]))
    oqa = Retriever.from_pretrained(runs / "openqa" / "final" / "retriever").eval()
    result["openqa_query_max_abs_diff"] = diff(oqa.query(x["q_ids"], x["q_mask"]), ref["openqa_query"])

    # Knowledge-augmented encoder: HF's loss is the marginal NLL summed over masked tokens,
    # divided by their count.
    enc = KnowledgeAugmentedEncoder.from_pretrained(str(runs / "encoder" / "final" / "encoder")).eval()
    m = int(x["mlm_mask"].sum(1).max())
    positions = torch.zeros(B, m, dtype=torch.long)
    labels = torch.zeros(B, m, dtype=torch.long)
    label_mask = torch.zeros(B, m, dtype=torch.bool)
    for b in range(B):
        p = x["mlm_mask"][b].nonzero().squeeze(1)
        positions[b, : len(p)], labels[b, : len(p)], label_mask[b, : len(p)] = p, x["labels"][b, p], True
    logits = enc(x["ka_ids"].flatten(0, 1), x["ka_types"].flatten(0, 1), x["ka_mask"].flatten(0, 1),
                 positions.repeat_interleave(K, 0))  # [B*K, M, V]
    log_py = masked_token_log_probs(rearrange(logits, "(b k) m v -> b k m v", b=B), labels)  # [B, K, M]
    nll = marginal_nll(x["ka_relevance"].log_softmax(-1), log_py, label_mask)  # [B]
    loss = nll.sum() / label_mask.sum()
    result["mlm_loss"] = {"ralm": float(loss), "hf": float(ref["mlm_loss"]), "abs_diff": abs(float(loss) - float(ref["mlm_loss"]))}

    # Reader: span logits on every valid span, and the predicted span under HF's rule
    # (argmax over blocks and spans of span logit + relevance score).
    for name in ("reader", "openqa"):
        reader = Reader.from_pretrained(runs / name / "final" / "reader").eval()
        batch = ReaderBatch(x["r_ids"], x["r_mask"], x["r_types"], x["ev_start"], x["ev_end"], [[] for _ in range(K)], [""] * K)
        scores = reader(batch)  # [K, L, W]
        valid = valid_spans(batch, reader.cfg.max_span_width)
        starts, ends = ref[f"{name}_starts"], ref[f"{name}_ends"]
        hf_valid = ref[f"{name}_logits"] > -1e30  # HF adds finfo.min to invalid spans
        ours = scores[:, starts, ends - starts]  # [K, spans]
        same_valid = bool((valid[:, starts, ends - starts] == hf_valid).all()) and int(valid.sum()) == int(hf_valid.sum())
        joint = (scores.masked_fill(~valid, -1e30) + x["r_relevance"][:, None, None]).flatten()
        block, rest = divmod(int(joint.argmax()), scores.shape[1] * scores.shape[2])
        start, width = divmod(rest, scores.shape[2])
        hf_block, hf_start, hf_end = (int(v) for v in ref[f"{name}_predicted"])
        s, w, _ = best_spans(scores, valid)
        hf_rows = ref[f"{name}_logits"].argmax(1)
        hf_joint = (ref[f"{name}_logits"] + x["r_relevance"][:, None]).flatten().topk(2).values
        result[name] = {
            "span_logits_max_abs_diff": diff(ours[hf_valid], ref[f"{name}_logits"][hf_valid]),
            "valid_spans_equal": same_valid,
            "predicted_span": {"ralm": [block, start, start + width], "hf": [hf_block, hf_start, hf_end]},
            "per_block_best_equal": bool(((s == starts[hf_rows]) & (s + w == ends[hf_rows])).all()),
            "hf_top2_gap": float(hf_joint[0] - hf_joint[1]),  # how far the prediction is from a tie
        }
    checks = {
        "blocks = RealmTokenizer pairs": result["blocks_equal_pair_encoding"],
        "relevance": result["relevance_max_abs_diff"] <= TOL,
        "embedder (tied towers)": result["embedder_max_abs_diff"] <= TOL,
        "openqa query embedder": result["openqa_query_max_abs_diff"] <= TOL,
        "mlm marginal loss": result["mlm_loss"]["abs_diff"] <= TOL,
        **{f"{n} span logits": result[n]["span_logits_max_abs_diff"] <= TOL and result[n]["valid_spans_equal"] for n in ("reader", "openqa")},
        **{f"{n} predicted span": result[n]["predicted_span"]["ralm"] == result[n]["predicted_span"]["hf"]
           and result[n]["per_block_best_equal"] for n in ("reader", "openqa")},
    }
    result["checks"] = checks
    result["passed"] = all(checks.values())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("all", "hf", "ralm"), default="all")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hf-realm-compat"))
    ap.add_argument("--hf-python", default="/tmp/venv-hf4/bin/python", help="python of a venv with transformers==4.57.6")
    ap.add_argument("--vocab", type=Path, help="vocab.txt for the tiny models (default: the bundled MiniLM's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model sizes of the HF models")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "hf":
        return stage_hf(args.work, args.vocab, args.seed, args.preset)
    start = time.perf_counter()
    if args.stage == "all":
        if args.vocab is None:
            from ralm.encoders.loading import default_model_path

            args.vocab = Path(default_model_path()) / "vocab.txt"
        subprocess.run([args.hf_python, __file__, "--stage", "hf", "--work", str(args.work), "--vocab", str(args.vocab),
                        "--seed", str(args.seed), "--preset", args.preset], check=True)
    result = stage_ralm(args.work)
    result["hf"] = json.loads((args.work / "hf.json").read_text())
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
