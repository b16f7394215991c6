"""LatencyHistogram: exact nearest-rank percentiles over the recent window, totals over every sample."""

from pagedweight.runtime.latency_histogram import RECENT, LatencyHistogram


def test_percentiles_and_totals():
    h = LatencyHistogram()
    assert h.state()["p50_us"] is None and h.state()["count"] == 0
    for v in range(1, 101):  # 1..100 us
        h.add(float(v))
    st = h.state()
    assert (st["count"], st["p50_us"], st["p99_us"], st["max_us"], st["mean_us"]) == (100, 50.0, 99.0, 100.0, 50.5)


def test_window_keeps_the_recent_samples_only():
    h = LatencyHistogram()
    h.add(1e6)  # one old outlier
    for _ in range(RECENT):
        h.add(10.0)
    st = h.state()
    assert st["p99_us"] == 10.0 and st["max_us"] == 1e6 and st["count"] == RECENT + 1 and st["window"] == RECENT
