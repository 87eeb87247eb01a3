"""The README's main command (`python -m ikbo_jax`) runs end to end on a CPU."""

from ikbo_jax import __main__ as main_job


def test_main_job_trains_and_serves_both_builds(tmp_path):
  report = main_job.main(["--steps", "30", "--requests", "30", "--qps", "200",
                          "--out", str(tmp_path / "report.json")])
  assert report["auc_after"] > report["auc_before"]
  assert report["build_difference"] < 1e-4
  for build in ("ikbo", "standard"):
    stats = report["serving"][build]
    # Every request is answered or refused for its deadline (the server's policy when a
    # slow machine stalls it for a second); nothing else goes wrong.
    assert stats["answered"] + stats["errors_by_kind"].get("deadline", 0) == 30, stats
    assert stats["answered"] >= 27 and stats["p99_ms"] > 0, stats
