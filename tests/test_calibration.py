"""Confidence calibration: isotonic regression against the max-min formula, monotonicity,
reliability bins by hand, the stored form."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from ralm.errors import RalmError
from ralm.eval.calibration import fit_isotonic, reliability, threshold_at_coverage
from ralm.models.confidence import Calibration


def _isotonic_brute_force(y: np.ndarray) -> np.ndarray:
    """The isotonic fit of y (sorted by score, distinct scores): f(i) = max_{j<=i} min_{k>=i} mean(y[j..k])."""
    n = len(y)
    return np.array([max(min(y[j : k + 1].mean() for k in range(i, n)) for j in range(i + 1)) for i in range(n)])


def test_isotonic_fit_equals_the_max_min_formula():
    rng = np.random.default_rng(0)
    for _ in range(20):
        scores = np.sort(rng.choice(np.linspace(0, 1, 1000), size=12, replace=False))
        correct = (rng.random(12) < scores).astype(float)
        cal = fit_isotonic(scores, correct, smoothing=0)
        want = _isotonic_brute_force(correct)
        # each step's value sits at its mean score, so the fit at the data points is recovered there
        for value in np.unique(want):
            at = scores[want == value]
            assert cal(at.mean()) == pytest.approx(value)
        assert len(cal.raw) == len(np.unique(want)) and cal.questions == 12


def test_calibrated_confidence_is_monotone_in_the_raw_score():
    rng = np.random.default_rng(1)
    scores = rng.random(500) ** 3  # raw p(z|x)·p(span|z,x): mostly small
    correct = (rng.random(500) < np.sqrt(scores)).astype(float)
    cal = fit_isotonic(scores, correct)
    grid = np.linspace(-0.5, 1.5, 4001)
    conf = cal(grid)
    assert np.all(np.diff(conf) >= 0) and conf.min() >= 0 and conf.max() <= 1
    assert conf[0] == cal.confidence[0] and conf[-1] == cal.confidence[-1]  # constant beyond the ends


def test_ties_and_a_hand_worked_fit():
    cal = fit_isotonic([0.1, 0.2, 0.3, 0.4, 0.4], [1, 0, 1, 1, 0], smoothing=0)
    # 0.1 -> 1 and 0.2 -> 0 violate: pooled to 0.5 at score 0.15; 0.3 -> 1 then the tie 0.4 -> 0.5
    # violates: pooled to 2/3 at 1.1 / 3, which then exceeds 0.5, so it stays
    assert cal.raw == pytest.approx((0.15, 1.1 / 3)) and cal.confidence == pytest.approx((0.5, 2 / 3))
    with pytest.raises(RalmError, match="as many scores"):
        fit_isotonic([0.1], [])
    # add-one smoothing: the pooled steps 1/2 and 2/3 become 2/4 and 3/5; 3 right of 3 is not certain
    assert fit_isotonic([0.1, 0.2, 0.3, 0.4, 0.4], [1, 0, 1, 1, 0]).confidence == pytest.approx((0.5, 0.6))
    assert fit_isotonic([0.1, 0.5, 0.9], [1, 1, 1]).confidence == pytest.approx((0.8,))


def test_json_round_trip_and_validation():
    cal = fit_isotonic([0.1, 0.5, 0.9], [0, 1, 1])
    again = Calibration.from_json(cal.to_json(), "x")
    assert again(0.3) == pytest.approx(cal(0.3))
    with pytest.raises(RalmError, match="x: calibration"):
        Calibration.from_json({"raw": [0.5, 0.1], "confidence": [0.1, 0.2]}, "x")
    with pytest.raises(RalmError, match="calibration"):
        Calibration.from_json({"raw": [0.1, 0.5], "confidence": [0.3, 0.2]}, "x")


def test_reliability_bins_by_hand():
    rel = reliability([0.05, 0.15, 0.85, 0.95, 0.9], [0, 1, 1, 1, 0], bins=10, thresholds=(0.5, 0.99))
    assert [(b["lo"], b["count"], b["accuracy"]) for b in rel["bins"]] == [(0.0, 1, 0.0), (0.1, 1, 1.0), (0.8, 1, 1.0), (0.9, 2, 0.5)]
    assert rel["ece"] == pytest.approx((0.05 + 0.85 + 0.15 + 2 * abs(0.925 - 0.5)) / 5, abs=1e-4)
    assert rel["at"] == [{"min_confidence": 0.5, "answered": 0.6, "accuracy": pytest.approx(2 / 3, abs=1e-4)},
                         {"min_confidence": 0.99, "answered": 0.0, "accuracy": None}]


def _signals(rng, n):
    """Answers whose log-partition tells right from wrong (with noise); the raw score alone less so."""
    right = rng.random(n) < 0.5
    sig = [{"score": float(rng.uniform(0.2, 0.9)), "log_partition": float(rng.normal(2.0 if r else -1.0, 1.0)),
            "retrieval_entropy": float(rng.uniform(0, 2)), "top_dense": float(rng.uniform(5, 15)), "top_bm25": float(rng.uniform(5, 15)),
            "agreement": 1.0} for r in right]
    return sig, right.astype(float)


def test_selective_fit_is_the_penalised_maximum_likelihood():
    from ralm.eval.calibration import fit_selective
    from ralm.models.confidence import feature_vector

    rng = np.random.default_rng(0)
    sig, y = _signals(rng, 400)
    cal = fit_selective(sig, y, l2=1.0)
    # constant features (agreement 1) are left out, and the raw BM25 score (its scale is the corpus's
    # own) is not fitted; the rest are standardised
    assert cal.features == ("logit_score", "log_partition", "retrieval_entropy", "top_dense")
    z = (np.stack([feature_vector(s, cal.features) for s in sig]) - cal.mean) / cal.scale
    p = cal.of_signals(sig)
    # at the optimum the gradient of the log-likelihood minus the L2 penalty is zero
    grad_w = z.T @ (p - y) + 1.0 * np.array(cal.weights)
    assert np.abs(grad_w).max() < 1e-6 and abs((p - y).sum()) < 1e-6
    assert cal.weights[1] > 1.0 and all(abs(w) < 0.5 for i, w in enumerate(cal.weights) if i != 1)
    assert 0 < p.min() and p.max() < 1  # never certain


def test_cross_fitted_confidence_is_measured_on_questions_the_map_did_not_see():
    from ralm.eval.calibration import auroc, cross_fitted, fit_selective

    rng = np.random.default_rng(1)
    sig, y = _signals(rng, 300)

    def fit(rows):
        return fit_selective([sig[i] for i in rows], y[rows])

    out = cross_fitted(sig, fit)
    even = fit_selective([s for i, s in enumerate(sig) if i % 2], y[1::2])  # fitted on the odd questions
    assert np.allclose(out[0::2], even.of_signals(sig[0::2]))
    assert auroc(out, y > 0) > 0.85
    # leave-article-out: each article's questions are predicted by a map fitted on the others alone
    articles = [f"a{i % 7}" for i in range(300)]
    by_article = cross_fitted(sig, fit, groups=articles)
    rows = np.array([a != "a3" for a in articles])
    without = fit_selective([s for s, r in zip(sig, rows) if r], y[rows])
    assert np.allclose(by_article[~rows], without.of_signals([s for s, r in zip(sig, rows) if not r]))


def test_auroc_is_none_where_nothing_can_be_ranked():
    from ralm.eval.calibration import auroc

    assert auroc([0.2, 0.9, 0.4], [False, False, False]) is None and auroc([0.2, 0.9], [True, True]) is None
    assert auroc([0.2, 0.9, 0.4], [False, True, False]) == 1.0


def _two_stage_signals(rng, n):
    """Questions whose answer is found in what was read (told by the log-partition and the null
    mass), and, when found, right by p(a|x); p(a|x) tells nothing about 'found'."""
    found = rng.random(n) < 0.6
    score = rng.uniform(0.05, 0.95, n)
    right = found & (rng.random(n) < score)
    sig = [{"score": float(s), "p_null": float(1 / (1 + np.exp(-rng.normal(-2.0 if f else 1.5, 1.0)))),
            "log_partition": float(rng.normal(1.5 if f else -0.5, 1.0)), "retrieval_entropy": float(rng.uniform(0, 2)),
            "agreement": float(rng.uniform(0, 1)), "top_dense": float(rng.uniform(5, 15))}
           for s, f in zip(score, found)]
    return sig, found.astype(float), right.astype(float)


def test_two_stage_confidence_is_found_times_right_given_found():
    from ralm.eval.calibration import auroc, fit_selective, fit_two_stage
    from ralm.models.confidence import RIGHT, Calibrations, TwoStageCalibration

    rng = np.random.default_rng(3)
    sig, found, right = _two_stage_signals(rng, 1200)
    cal = fit_two_stage(sig[:600], found[:600], right[:600], fitted_with={"reader": "abc", "k": 10})
    read = found[:600] > 0
    by_hand = fit_selective([s for s, f in zip(sig[:600], read) if f], right[:600][read], features=RIGHT)
    assert np.allclose(cal.right.of_signals(sig[600:]), by_hand.of_signals(sig[600:]))  # stage two sees found questions only
    conf = cal.of_signals(sig[600:])
    assert np.allclose(conf, cal.found.of_signals(sig[600:]) * cal.right.of_signals(sig[600:]))
    one = fit_selective(sig[:600], right[:600], features=("logit_score", "log_partition", "logit_null"))
    assert auroc(conf, right[600:] > 0) > auroc(one.of_signals(sig[600:]), right[600:] > 0)  # held out
    again = Calibrations.from_json(json.loads(json.dumps(Calibrations({"hybrid": cal}).to_json())), "x").for_kind("hybrid")
    assert isinstance(again, TwoStageCalibration) and again.fitted_with == {"reader": "abc", "k": 10}
    assert np.allclose(again.of_signals(sig[600:]), conf, atol=1e-6)
    missed = found[:600].copy()
    missed[np.flatnonzero(right[:600])[:3]] = 0  # right answers the token match of `found` missed
    assert np.allclose(fit_two_stage(sig[:600], missed, right[:600]).of_signals(sig[600:]), conf)  # counted as found


def test_the_default_maps_withhold_answers_read_in_a_siblings_record():
    """Answers read in a sibling's record (the question's names missing from the answer's title
    and context) look found on every other signal; the default features read the names'
    coverage, so held out they rank below right answers and are withheld, which a fit without
    it does not do."""
    from ralm.eval.calibration import auroc, fit_two_stage
    from ralm.models.confidence import FOUND, RIGHT

    rng = np.random.default_rng(5)
    sig, found, right = _two_stage_signals(rng, 1600)
    sibling = (found > 0) & (rng.random(1600) < 0.4)  # read as found; its names are not in the context
    for s, sib in zip(sig, sibling):
        s["entity_coverage"] = 0.0 if sib else float(rng.choice([1.0, 1.0, 0.5]))
    found, right = found * ~sibling, right * ~sibling
    train, test = slice(0, 800), slice(800, None)
    held = sig[test]
    with_names = fit_two_stage(sig[train], found[train], right[train]).of_signals(held)
    without = fit_two_stage(sig[train], found[train], right[train], found_features=[f for f in FOUND if f != "entity_coverage"],
                            right_features=[f for f in RIGHT if f != "entity_coverage"]).of_signals(held)
    ok = right[test] > 0
    assert auroc(with_names, ok) > auroc(without, ok) + 0.05
    # at a threshold of 0.3: most of the siblings' answers withheld with the names, not without
    assert (with_names[sibling[test]] >= 0.3).mean() < 0.1 and (without[sibling[test]] >= 0.3).mean() > 0.3


def test_a_map_read_with_another_reader_or_k_warns_once():
    from ralm.errors import RalmWarning
    from ralm.eval.calibration import fit_two_stage
    from ralm.models.confidence import check_fitted_with

    sig, found, right = _two_stage_signals(np.random.default_rng(4), 200)
    cal = fit_two_stage(sig, found, right, fitted_with={"reader": "abc", "k": 10})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_fitted_with(cal, kind="hybrid", reader="abc", k=10)  # as fitted: silent
        check_fitted_with(cal, kind="hybrid", reader="xyz", k=5)
        check_fitted_with(cal, kind="hybrid", reader="xyz", k=5)  # the same mismatch again: silent
    assert len(caught) == 1 and issubclass(caught[0].category, RalmWarning)
    assert "another reader" in str(caught[0].message) and "k = 10" in str(caught[0].message)


def test_a_readers_maps_are_chosen_by_the_retriever_kind_and_round_trip():
    from ralm.eval.calibration import fit_selective
    from ralm.models.confidence import Calibrations, SelectiveCalibration

    rng = np.random.default_rng(2)
    sig, y = _signals(rng, 200)
    old = fit_isotonic([s["score"] for s in sig], y)
    maps = Calibrations.from_json(old.to_json(), "x")  # an older reader: one map for every kind
    assert maps.for_kind("hybrid") is maps.for_kind("bm25") and maps.for_kind("bm25").raw == pytest.approx(old.raw)
    hybrid = fit_selective(sig, y)
    maps = maps.with_kind("hybrid", hybrid)
    again = Calibrations.from_json(json.loads(json.dumps(maps.to_json())), "x")
    assert isinstance(again.for_kind("hybrid"), SelectiveCalibration) and again.for_kind("dense").raw == pytest.approx(old.raw)
    assert np.allclose(again.for_kind("hybrid").of_signals(sig), hybrid.of_signals(sig), atol=1e-6)
    with pytest.raises(RalmError, match="selective calibration needs"):
        Calibrations.from_json({"by_retriever": {"dense": {"method": "selective", "features": ["nope"]}}}, "x")
    assert "by_kind" in maps.to_json() and Calibrations.from_json({"by_retriever": maps.to_json()["by_kind"]}, "x").by_kind.keys() \
        == maps.by_kind.keys()  # readers of ralm 0.4 wrote by_retriever
    fallback = maps.with_kind("*", hybrid)
    assert fallback.for_kind("a-new-kind") is hybrid  # any kind gets a map, so it withholds answers too


def test_the_threshold_at_a_coverage_is_the_highest_that_answers_that_share_of_the_answerable():
    confidence = [0.9, 0.8, 0.55, 0.3, 0.95, 0.2]
    unanswerable = [False, False, False, False, True, True]
    assert threshold_at_coverage(confidence, unanswerable, 0.5) == 0.8  # 2 of the 4 answerable; the unanswerable 0.95 aside
    assert threshold_at_coverage(confidence, unanswerable, 0.75) == 0.55
    assert threshold_at_coverage(confidence, unanswerable, 1.0) == 0.3
    assert threshold_at_coverage([0.0, 0.001], [False, False], 1.0) == 0.0
    assert threshold_at_coverage(confidence[4:], unanswerable[4:], 0.5) is None  # nothing answerable to choose it on
