"""benchmarks/pipeline.py runs (a smoke run at tiny size): it cannot rot."""

from benchmarks import pipeline


def test_pipeline_benchmark_smoke(capsys, tmp_path):
    out = pipeline.main(["--quick", "--json", str(tmp_path / "pipeline.json")])
    assert set(out["loops"]) == set(pipeline.LOOPS)
    for r in out["loops"].values():
        assert r["ms_per_step"] > 0 and r["steps"] == pipeline.PRESETS["quick"]["steps"]
    assert out["overlap"]["prefetched_over_max"] > 0
    assert (tmp_path / "pipeline.json").exists()
    assert "(d) / max(a, b)" in capsys.readouterr().out
