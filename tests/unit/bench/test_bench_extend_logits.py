"""The output-head benchmark runs end to end on a tiny model and reports both timings."""

from scd_serve.bench.extend_logits import main
from scd_serve.model.tiny import save_tiny_model


def test_reports_median_seconds_and_their_ratio(tmp_path):
    out = main([str(save_tiny_model(tmp_path / "m", "llama")), "--tokens", "20", "--repeats", "2"])
    assert out["tokens"] == 20 and out["all_s"] > 0 and out["none_s"] > 0
    assert out["ratio"] > 0
