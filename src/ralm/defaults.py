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
COMPACT_AFTER = 10_000  # update records an index's log holds before a server compacts it into a version (search/compaction.py)
