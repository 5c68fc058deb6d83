"""The benchmarks run (a smoke run at tiny size): they cannot rot."""

from benchmarks import peers, step


def test_step_benchmark_smoke(capsys):
    """--quick with every optimizer and every installed peer; peers that are not installed get a status row."""
    out = step.main(["--quick", "--optimizer", "all", "--steps", "2", "--vocab-rounds", "1"])
    systems = out["systems"]
    ours = systems["sparse_embed"]["steps"]
    assert set(ours) == {"forward"} | {f"train_{o}" for o in step.OPTIMIZERS}
    for r in ours.values():
        assert r["median_ms"] > 0 and r["hlo_table_copies"] == 0
    assert not peers.PEERS["flax"].missing()  # flax and optax are sparse_embed dependencies: always compared
    for key, peer in peers.PEERS.items():
        if not peer.missing():
            assert set(systems[key]["steps"]) == set(peer.measurements), key
            assert all(r["median_ms"] > 0 and r["state_bytes"] > 0 for r in systems[key]["steps"].values())
            assert out["agreement"][key] <= step.AGREEMENT_TOLERANCE  # same forward and SGD update
        else:
            assert systems[key]["status"].startswith("not installed") and not systems[key]["steps"]
    bound = out["lower_bound"]
    assert all(ms > 0 for source in bound["ms"].values() for ms in source.values())
    rows = {(r["measurement"], r["system"]) for r in out["comparison"]}
    assert ("train_sgd", "flax") in rows and ("forward", "sparse_embed") in rows
    assert len(out["targets"]) == len(step.TARGETS) + 1 and not any(t["applicable"] for t in out["targets"])
    for key in ("same_batch", "full_range"):
        assert out["vocab"][key]["ratio"] > 0
    printed = capsys.readouterr().out
    assert "side by side" in printed and "vocabulary independence" in printed


def test_preprocess_benchmark_smoke(capsys):
    from benchmarks import preprocess

    out = preprocess.main(["--quick"])
    assert {(r["input"], r["devices"]) for r in out["rows"]} == {
        (i, d) for i in ("dense", "ragged") for d in (1, 8)}
    assert all(r["sparse_embed_s"] > 0 for r in out["rows"])
    assert "ratio" in capsys.readouterr().out
