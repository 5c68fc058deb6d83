"""benchmarks/input.py runs (a smoke run at tiny size): it cannot rot."""

from benchmarks import input as input_benchmark


def test_input_benchmark_smoke(capsys, tmp_path):
    out = input_benchmark.main(["--quick", "--steps", "2", "--lines", "3000", "--json", str(tmp_path / "in.json")])
    assert set(out["loops"]) == set(input_benchmark.LOOPS)
    for r in out["loops"].values():
        assert r["examples_per_s"] > 0 and r["steps"] == 2
    c = out["criteo"]
    assert c["lines"] == 3000 and c["source_lines_read"] == 2048 and c["parse_lines_per_s"] > 0
    assert (tmp_path / "in.json").exists()
    assert "se.data.Loader / se.prefetch examples/s" in capsys.readouterr().out
