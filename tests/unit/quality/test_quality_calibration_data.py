"""Calibration's three sets are split by document: the report set, on which the codebook's
figures are measured, never shares a document with what was fitted or probed."""

import pytest

from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import ConfigError
from scd_serve.quality.calibration_data import split_by_document, split_sizes


def test_whole_documents_from_the_end_go_to_report_then_probe():
    docs = ["a", "a", "b", "b", "b", "c", "d", "d", "e", "e"]
    fit, probe, report = split_by_document(docs, probe=2, report=2)
    assert report == [8, 9] and probe == [6, 7] and fit == [0, 1, 2, 3, 4, 5]
    # a document larger than what is asked for is taken whole, not cut
    fit, probe, report = split_by_document(docs, probe=1, report=3)
    assert report == [6, 7, 8, 9] and probe == [5] and fit == [0, 1, 2, 3, 4]
    for f_docs, p_docs, r_docs in [({docs[i] for i in fit}, {docs[i] for i in probe}, {docs[i] for i in report})]:
        assert not (f_docs & p_docs) and not (f_docs & r_docs) and not (p_docs & r_docs)


def test_records_without_a_source_are_each_their_own_document():
    fit, probe, report = split_by_document([f"f:{i}" for i in range(10)], probe=3, report=2)
    assert report == [8, 9] and probe == [5, 6, 7] and fit == list(range(5))


def test_too_few_documents_to_hold_out_is_one_clear_error():
    with pytest.raises(ConfigError, match="cannot hold out whole documents: 2 documents for 6 records"):
        split_by_document(["a"] * 3 + ["b"] * 3, probe=1, report=1)


def test_small_files_keep_an_eighth_each_for_probe_and_report():
    cfg = CalibrateConfig(kl_budget=0.05)  # 192 + 24 + 24 asked for
    assert split_sizes(400, cfg) == (192, 24, 24)
    assert split_sizes(200, cfg) == (152, 24, 24)  # 200 < 240: probe and report stay at 24 (200 // 8 = 25)
    assert split_sizes(40, cfg) == (30, 5, 5)
    with pytest.raises(ConfigError, match="at least 3 usable records"):
        split_sizes(2, cfg)
