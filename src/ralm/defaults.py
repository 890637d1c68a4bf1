"""Defaults of retrieval and open-domain QA shared by the library, the CLI and the server, chosen
on the calibration half of SQuAD official dev and confirmed on the held-out half
(benchmarks/RESULTS.md). No heavy imports: the CLI reads them at start-up."""

READ_K = 10  # blocks read per question; 10 over 5: +1.4 EM dense, +0.3 hybrid (calibration half)
HYBRID_ALPHA = 0.7  # the dense score's weight in hybrid search (BM25's: 1 - alpha); 0.5 was 0.5 EM worse
# Weighted fusion's weight of each side, normalised over the sides fused; a side not named here
# weighs an equal share (1 / the number of sides fused) before that.
FUSION_WEIGHTS = {"dense": HYBRID_ALPHA, "bm25": 1 - HYBRID_ALPHA}
FUSION = "weighted"  # how an index's sides are fused (retrieval/search/fusion.py FUSIONS)
FUSION_DEPTH = 100  # each side's list that fusion draws candidates from
RRF_C = 60  # reciprocal rank fusion's constant (Cormack et al., 2009)
# Answers whose calibrated P(correct) is below this are withheld when their confidence map records
# no threshold of its own (every map `ralm eval qa --calibrate` writes records one): ralm 0.4's
# reader's hybrid threshold, the lowest at which at most 7% of the calibration half's unanswerable
# questions (their article removed from the corpus) got an answer (benchmarks/RESULTS.md,
# "Hybrid retrieval and selective answering").
MIN_CONFIDENCE = 0.41  # of a confidence map that records no threshold of its own
COMPACT_AFTER = 10_000  # update records an index's log holds before a server compacts it into a version (search/compaction.py)

# Defaults of the other commands, each read by the library function it configures and by the
# command's config (commands/), so that the two cannot drift apart.
SEARCH_K = 5  # passages `ralm search` (and Searcher.search) returns
MAX_QUESTION_CHARS = 2000  # the longest question or search query: argv, stdin, question files and HTTP alike (50 MB ran 340 s)
INDEX_KIND = "hybrid"  # what an index version holds: a dense and a BM25 side, searched fused
FAISS_AUTO = "auto"  # the dense side's search chosen from the number of vectors (faiss_index.auto_spec)
EMBED_BATCH = 64  # blocks (chunks) embedded per forward pass: memory against speed
QA_BATCH = 8  # questions per reader batch in `ralm eval qa`
# `ralm eval qa --calibrate`'s threshold rule: the lowest confidence at which at most this share of
# each calibration set's unanswerable questions get an answer (a margin under a 10% target).
MAX_UNANSWERABLE = 0.07
RETRIEVAL_KS = (1, 5, 20, 100)  # recall@k cut-offs of `ralm eval retrieval`
SERVE_HOST = "127.0.0.1"  # a server binds the loopback unless told otherwise
MAX_BODY_MB = 1  # the largest request body a server reads, in MiB
LM_BATCH = 16  # sequences per forward pass of a causal LM (perplexity, kNN-LM datastore)
RETRO_BATCH = 8  # sequences per forward pass of RETRO's perplexity
CHUNK_LEN = 64  # wordpieces per RETRO chunk (the paper's 64)
MAX_NEW_TOKENS = 64  # wordpieces RETRO generates
SAMPLE_TEMPERATURE = 1.0  # softmax temperature of RETRO's nucleus sampling
KNN_K = 1024  # kNN-LM neighbours per token (Khandelwal et al.)
KNN_LAMBDA = 0.25  # kNN-LM's interpolation weight of p_kNN
KNN_TEMPERATURE = 1.0  # kNN-LM's softmax temperature over -distance
NPROBE = 32  # IVF lists searched in an approximate kNN-LM datastore
REALM_K = 8  # blocks retrieved per masked sentence in REALM pre-training and its evidence gain
EVIDENCE_SENTENCES = 300  # masked held-out sentences the evidence gain scores
EVIDENCE_BATCH = 16  # sentences per forward pass of the evidence gain
