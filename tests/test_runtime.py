"""Compute dtypes: auto/fp32/bf16 resolution, bf16 exact search, bf16 training with fp32
master weights, and logits that stay fp32 inside autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.backends.exact import ExactIndex
from ralm.runtime import Runtime, autocast, cpu_has_bf16, resolve_dtype

CPU = torch.device("cpu")
FP32 = Runtime(CPU, torch.float32, show_progress=False)
needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16")


def test_auto_is_bf16_on_cuda_and_on_cpus_with_native_bf16(monkeypatch):
    import ralm.runtime as runtime

    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp32", torch.device("cuda")) == torch.float32
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", CPU) == resolve_dtype(None, CPU) == torch.bfloat16
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32  # falls back, no error
    with pytest.raises(RalmError, match="no native bf16"):
        resolve_dtype("bf16", CPU)
    with pytest.raises(RalmError, match="^dtype must be one of auto, fp32, bf16"):  # the library names the field
        resolve_dtype("fp16", CPU)


def test_a_runtime_is_the_device_dtype_and_progress_of_a_job_resolved_once(monkeypatch):
    import ralm.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: False)
    assert Runtime.resolve("cpu", "fp32", show_progress=False) == Runtime(torch.device("cpu"), torch.float32, False)
    assert Runtime.resolve("cpu").dtype == torch.float32  # auto on a CPU without native bf16
    with pytest.raises(RalmError, match="dtype bf16: this CPU has no native bf16"):
        Runtime.resolve("cpu", "bf16")
    with pytest.raises(RalmError, match="--device must be auto, cpu, cuda or cuda:N"):
        Runtime.resolve("gpu0")


def test_cli_bf16_on_a_cpu_without_it_is_a_one_line_error(monkeypatch, ralm, tiny_bert, corpus_file, tmp_path):
    import ralm.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: False)
    code, _, err = ralm("index", "build", corpus_file, "--out", tmp_path / "i", "--model", tiny_bert, "--dtype", "bf16")
    assert code == 2 and "--dtype bf16: this CPU has no native bf16" in err and "Traceback" not in err  # the CLI, the flag
    assert not (tmp_path / "i").exists()  # refused before any work
    code, _, err = ralm("ict", "--corpus", corpus_file, "--out", tmp_path / "r", "--model", tiny_bert, "--dtype", "bf16")
    assert code == 2 and "--dtype bf16: this CPU has no native bf16" in err


@pytest.fixture
def resolutions(monkeypatch):
    """Count every device and dtype resolution, wherever a module of ralm holds the resolver
    (`from ralm.runtime import resolve_dtype` binds a name of its own)."""
    import sys

    import ralm.runtime as runtime

    counts = {"device": 0, "dtype": 0}

    def counted(what, resolve):
        def wrapper(*args, **kwargs):
            counts[what] += 1
            return resolve(*args, **kwargs)
        return wrapper

    for what, resolve in (("device", runtime.resolve_device), ("dtype", runtime.resolve_dtype)):
        wrapper = counted(what, resolve)
        for name, module in list(sys.modules.items()):
            if (name == "ralm" or name.startswith("ralm.")) and getattr(module, resolve.__name__, None) is resolve:
                monkeypatch.setattr(module, resolve.__name__, wrapper)
    return counts


def test_every_public_entry_resolves_its_runtime_once_and_nothing_below_it_again(resolutions, tiny_bert, tmp_path):
    """`build_index`, `OpenQA.open(...).answer`, `Searcher.open(...).search` and a trainer's
    `fit` each resolve the device and dtype once, at the entry; a Runtime given is not resolved
    again anywhere below (a lower function re-resolving would count here)."""
    import json

    from conftest import DOCS
    from ralm.models.reader import Reader
    from ralm.pipeline import OpenQA
    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.search.searcher import Searcher
    from ralm.train.finetune import FinetuneConfig, finetune

    def once(run) -> dict:
        resolutions.update(device=0, dtype=0)
        run()
        return dict(resolutions)

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    index = tmp_path / "index"
    assert once(lambda: build_index(corpus, index, model=str(tiny_bert), dim=16, show_progress=False)) == {"device": 1, "dtype": 1}
    Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).save_pretrained(tmp_path / "reader")
    ask = lambda **rt: OpenQA.open(index, tmp_path / "reader", k=2, **rt).answer(["What is the capital of France?"])  # noqa: E731
    assert once(ask) == {"device": 1, "dtype": 1}
    assert once(lambda: ask(device="cpu", dtype="fp32")) == {"device": 1, "dtype": 1}  # the older keywords: the same
    assert once(lambda: Searcher.open(index).search(["capital of France"], k=2)) == {"device": 1, "dtype": 1}
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"]}) + "\n")
    cfg = FinetuneConfig(questions=str(questions), index=str(index), init=str(tiny_bert), steps=1, batch_size=1, k=2,
                         max_len=96, save_every=1, log_every=1, warmup=0)
    assert once(lambda: finetune(cfg, tmp_path / "run", show_progress=False)) == {"device": 1, "dtype": 1}

    given = FP32
    assert once(lambda: build_index(corpus, tmp_path / "again", model=str(tiny_bert), dim=16, runtime=given,
                                    show_progress=False)) == {"device": 0, "dtype": 0}
    assert once(lambda: ask(runtime=given)) == {"device": 0, "dtype": 0}
    assert once(lambda: finetune(cfg, tmp_path / "run2", runtime=given, show_progress=False)) == {"device": 0, "dtype": 0}


def test_a_runtime_given_with_the_older_keywords_or_against_the_run_config_is_refused(tmp_path):
    from ralm.train.loop import LoopConfig
    from ralm.train.parallel import start_run

    with pytest.raises(RalmError, match="give runtime= or device=/dtype=, not both"):
        Runtime.of(FP32, dtype="fp32")
    with pytest.raises(RalmError, match="^dtype bf16, but the runtime given computes in fp32"):  # the run records its dtype
        start_run(tmp_path / "run", LoopConfig(dtype="bf16"), FP32)


@needs_bf16
def test_bf16_and_fp32_exact_search_return_the_same_top_k():
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((70_000, 16), dtype=np.float32)
    q = rng.standard_normal((300, 16), dtype=np.float32)
    s32, i32 = ExactIndex(emb, dtype="fp32").search(q, 10)
    # 300 queries: more than one query block of the bf16 scan; chunk 7000: a ragged last chunk
    s16, i16 = ExactIndex(emb, dtype="bf16", chunk_size=7000).search(q, 10)
    # bf16 only shortlists; the shortlist is rescored in fp32, so ids and scores equal fp32's
    np.testing.assert_array_equal(i16, i32)
    np.testing.assert_allclose(s16, s32, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ExactIndex(emb, dtype="bf16").search(q, 10)[1], i32)  # default blocking
    assert ExactIndex(emb, dtype="bf16")._matrix.dtype == torch.bfloat16  # half the RAM of fp32
    assert ExactIndex(emb[:1000], dtype="bf16").dtype == torch.float32  # too small to pay: stays fp32


@needs_bf16
def test_bf16_encoding_matches_fp32_to_cosine_0_99(tiny_bert):
    r = Retriever.from_pretrained(str(tiny_bert)).eval()
    rng = np.random.default_rng(1)
    rows = [np.concatenate([[101], rng.integers(1000, 5000, size=int(n)), [102]]) for n in rng.integers(5, 60, size=20)]
    lengths = np.array([len(x) for x in rows])
    out = {d: encode_rows(r.doc, rows, lengths, out=np.zeros((20, r.dim), np.float32), batch_size=4, show_progress=False, dtype=d)
           for d in ("fp32", "bf16")}
    cos = torch.nn.functional.cosine_similarity(torch.from_numpy(out["fp32"]), torch.from_numpy(out["bf16"]))
    assert cos.min() > 0.99 and not np.array_equal(out["fp32"], out["bf16"])  # bf16 really ran


@needs_bf16
def test_a_bf16_training_step_updates_fp32_master_weights(tiny_bert):
    r = Retriever.from_pretrained(str(tiny_bert), dim=8).train()
    opt = torch.optim.SGD(r.parameters(), lr=0.1)
    weight = r.query.bert.encoder.layer[0].attention.self.query.weight
    before = weight.detach().clone()
    ids = torch.randint(1000, 5000, (4, 12))
    mask = torch.ones_like(ids)
    with autocast(CPU, torch.bfloat16):
        q, d = r(ids, mask, ids.flip(0), mask)
        assert r.query.bert(input_ids=ids, attention_mask=mask).pooler_output.dtype == torch.bfloat16  # matmuls ran in bf16
        loss = torch.nn.functional.cross_entropy(q @ d.T, torch.arange(4))
    loss.backward()
    opt.step()
    assert weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert not torch.equal(weight, before)


@needs_bf16
def test_relevance_logits_stay_fp32_inside_autocast():
    from ralm.models.realm import relevance_log_probs

    torch.manual_seed(0)
    q, docs = torch.randn(3, 16) * 4, torch.randn(3, 5, 16) * 4
    exact = relevance_log_probs(q, docs)
    with autocast(CPU, torch.bfloat16):
        mixed = relevance_log_probs(q, docs)
        naive = torch.einsum("bd,bkd->bk", q.float(), docs.float())  # what autocast does to an einsum
    assert naive.dtype == torch.bfloat16  # the trap: fp32 inputs, bf16 result
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, exact)


@needs_bf16
def test_lm_logits_stay_fp32_inside_autocast():
    from ralm.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    lm = TransformerLM(LMConfig(vocab_size=50, dim=32, layers=1, heads=2, max_len=16)).eval()
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        hidden = lm.features(ids)
        exact = hidden @ lm.embed.weight.T
        with autocast(CPU, torch.bfloat16):
            logits = lm.head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, exact)


# -- the seam: one Runtime from the public entries down -------------------------------------

# What a user calls (benchmarks/ too) takes `runtime=`, and the older `device=`/`dtype=` through
# `Runtime.of`, resolved there once; below these, a function takes the runtime.
PUBLIC_ENTRIES = {
    "ralm.retrieval.index.build:build_index", "ralm.retrieval.index.build:upgrade_index",
    "ralm.retrieval.search.searcher:Searcher.__init__", "ralm.retrieval.search.searcher:Searcher.open",
    "ralm.retrieval.search.live:LiveSearcher.open",
    "ralm.pipeline:OpenQA.__init__", "ralm.pipeline:OpenQA.open", "ralm.pipeline:open_searcher",
    "ralm.pipeline:read_blocks", "ralm.pipeline:read_batch",  # the reading studies call them (benchmarks/qa, reader)
    "ralm.retrieval.backends.exact:ExactIndex.__init__", "ralm.retrieval.backends.sharded:ShardedExactIndex.__init__",
    "ralm.retrieval.towers.encoding:encode_rows",  # the encoding benchmarks call it
    "ralm.eval.knowledge:score_checkpoint",  # benchmarks/realm
    "ralm.train.trainer:Trainer.fit", "ralm.train.parallel:start_run",
    # the LM stack (tests/test_lm.py checks it further)
    "ralm.eval.perplexity:lm_perplexity", "ralm.eval.perplexity:knnlm_eval", "ralm.eval.perplexity:retro_perplexity",
    "ralm.models.knnlm:build_datastore", "ralm.models.retro:neighbour_batch", "ralm.models.retro:generate",
    "ralm.retrieval.lm.chunkdb:build_chunk_db", "ralm.retrieval.lm.chunkdb:ChunkDB.__init__",
}
# device or dtype in another sense than a job's Runtime, each with its reason
OTHER_MEANINGS = {
    # a public method used on its own, taking the user's dtype spelling (and its shared body)
    "ralm.retrieval.towers.encoders:Retriever.encode_queries", "ralm.retrieval.towers.encoders:Retriever.encode_documents",
    "ralm.retrieval.towers.encoders:Retriever._encode",
    # torch's nn.Module convention: device="meta" builds a model without memory for its weights
    *(f"ralm.encoders.bert:{c}.__init__" for c in ("Embeddings", "SelfAttention", "DenseNorm", "BertAttention",
                                                   "Intermediate", "Layer", "Encoder", "Pooler", "Bert")),
    "ralm.encoders.bert:bert_from_config", "ralm.encoders.loading:bert_from_config",
    # numpy element types of arrays written to disk
    "ralm.data.ragged:RaggedWriter.__init__", "ralm.data.resumable:PartialBuild.fill",
    # tensor placement where the model already is (a batch's .to, DDP's device_ids, a step's
    # inputs next to its model's weights), and a group size read off a device's type
    "ralm.data.reader_features:ReaderBatch.to", "ralm.train.parallel:wrap_ddp", "ralm.train.dpr:_block_inputs",
    "ralm.train.finetune:retrieval_logits", "ralm.train.finetune:read_candidates", "ralm.encoders.length_groups:length_group",
}
# the Runtime's own module, and the command layer, whose options are spelled --device/--dtype
# and become one Runtime there (commands/shared.py `runtime`)
OWN_SPELLING = ("ralm.runtime", "ralm.cli", "ralm.commands.")


def device_or_dtype_functions() -> dict[str, set[str]]:
    """{"module:Qualified.name": its parameter names} of every function and method under
    src/ralm with a parameter named device or dtype, nested ones included, found by parsing."""
    import ast
    from pathlib import Path

    import ralm

    root = Path(ralm.__file__).parent
    found: dict[str, set[str]] = {}

    def visit(node, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
                if names & {"device", "dtype"}:
                    found[f"{module}:{prefix}{child.name}"] = names
                visit(child, module, f"{prefix}{child.name}.<locals>.")

    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        visit(ast.parse(path.read_text()), module, "")
    return found


def test_below_its_public_entries_the_library_takes_a_runtime_never_device_or_dtype():
    """A function of the library taking `device` or `dtype` is a public entry (which also takes
    `runtime=`), the command layer or the Runtime's own module, or one of the few where the word
    means something else; anything else threads by hand what the runtime carries."""
    found = device_or_dtype_functions()
    assert PUBLIC_ENTRIES | OTHER_MEANINGS <= set(found), sorted((PUBLIC_ENTRIES | OTHER_MEANINGS) - set(found))
    assert sorted(q for q in PUBLIC_ENTRIES if "runtime" not in found[q]) == []
    threaded = sorted(q for q in found if q not in PUBLIC_ENTRIES | OTHER_MEANINGS and not q.startswith(OWN_SPELLING))
    assert threaded == []
    from dataclasses import fields

    from ralm.retrieval.index.kinds import BuildContext

    held = {f.name for f in fields(BuildContext)}  # what every side's builder reads: the runtime, not its parts
    assert "runtime" in held and not held & {"device", "dtype"}


def test_exact_search_encoding_and_reading_give_the_same_numbers_under_a_runtime_and_the_older_keywords(resolutions,
                                                                                                          tiny_bert, tiny_dense_index):
    """`runtime=Runtime(cpu, fp32)` and `device="cpu", dtype="fp32"` are one computation at the
    public entries below the searcher (exact search, encoding, reading); both at once is refused;
    a Runtime given is never resolved again, down to the sides an index loads."""
    from ralm.models.reader import Reader
    from ralm.pipeline import read_blocks
    from ralm.retrieval.search.searcher import Searcher

    rng = np.random.default_rng(0)
    emb, q = rng.standard_normal((300, 16)).astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)
    r = Retriever.from_pretrained(tiny_bert, dim=16).eval()
    rows = [np.arange(2 + i % 5) + 100 for i in range(6)]
    lengths = np.array([len(x) for x in rows])
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).eval()
    pairs = (["What is the capital of France?"] * 2, ["Paris is the capital of France.", "The Nile flows north."])

    def encoded(**rt) -> np.ndarray:
        return encode_rows(r.doc, rows, lengths, out=np.zeros((6, r.dim), np.float32), show_progress=False, **rt)

    with torch.inference_mode():
        old = (ExactIndex(emb, device="cpu", dtype="fp32").search(q, 5), encoded(device="cpu", dtype="fp32"),
               read_blocks(reader, *pairs, device="cpu", dtype="fp32"))
        with pytest.raises(RalmError, match="give runtime= or device=/dtype=, not both"):
            ExactIndex(emb, runtime=FP32, dtype="fp32")
        resolutions.update(device=0, dtype=0)
        new = (ExactIndex(emb, runtime=FP32).search(q, 5), encoded(runtime=FP32), read_blocks(reader, *pairs, runtime=FP32))
        searcher = Searcher.open(tiny_dense_index, runtime=FP32)
        searcher.search(["capital of France"], k=2)
    assert resolutions == {"device": 0, "dtype": 0}
    for a, b in zip(old[0], new[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(old[1], new[1])
    assert old[2] == new[2]
    from ralm.retrieval.index.dense_side import dense_of

    dense = dense_of(searcher.current)
    assert dense.runtime is FP32 and dense.index.runtime == FP32  # the searcher's runtime, down to the exact index
