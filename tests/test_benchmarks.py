"""The benchmarks run (a smoke run at tiny size): they cannot rot."""

from benchmarks import step


def test_step_benchmark_smoke(capsys):
    out = step.main(["--small", "--optimizer", "all", "--steps", "2", "--warmup", "1", "--vocab-rounds", "1"])
    assert set(out["steps"]) == {"forward"} | {f"train_{o}" for o in step.OPTIMIZERS}
    for r in out["steps"].values():
        assert r["median_ms"] > 0 and r["hlo_table_copies"] == 0
    for key in ("same_batch", "full_range"):
        assert out["vocab"][key]["ratio"] > 0
    assert "vocabulary independence" in capsys.readouterr().out


def test_preprocess_benchmark_smoke(capsys):
    from benchmarks import preprocess

    out = preprocess.main(["--quick"])
    assert {(r["input"], r["devices"]) for r in out["rows"]} == {
        (i, d) for i in ("dense", "ragged") for d in (1, 8)}
    assert all(r["sparse_embed_s"] > 0 for r in out["rows"])
    assert "ratio" in capsys.readouterr().out
