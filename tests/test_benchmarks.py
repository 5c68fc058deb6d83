"""The benchmarks run (a smoke run at tiny size): they cannot rot."""

import gc
import json
import pathlib
import shutil
import subprocess

import pytest

from benchmarks import measuring, peers, report, step, systems, workload


@pytest.fixture
def frozen_heap():
    """The suite's heap frozen: a benchmark's garbage collections then scan only what it made."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.skipif(not measuring.trim_heap(), reason="glibc's malloc_trim only")
def test_free_memory_returns_what_the_last_system_freed(frozen_heap):
    """What a system freed but the allocator kept (here ~190 MB of 4 kB blocks between live ones) leaves the RSS
    the next system's peak is measured on."""
    blocks = [bytes(4000) for _ in range(50_000)]  # in malloc's heap: above pymalloc's sizes, below mmap's
    keep = blocks[::50]  # live blocks between the freed ones: free() alone returns none of those pages
    del blocks
    before = measuring.RSS.current()
    measuring.free_memory()
    assert before - measuring.RSS.current() > 100 * 2**20
    del keep


def test_step_benchmark_smoke(capsys, frozen_heap):
    """--quick with every optimizer, both kernels and every installed peer; missing peers get a status row."""
    out = step.main(["--quick", "--optimizer", "all", "--steps", "3", "--rounds", "2", "--vocab-rounds", "1"])
    measured = {"forward"} | {f"train_{o}" for o in workload.OPTIMIZERS}
    for kernel in systems.KERNELS:
        ours = out["systems"][systems.sparse_embed_key(kernel)]
        assert ours["kernel"] == kernel and set(ours["steps"]) == measured
        for r in ours["steps"].values():  # two rounds of ceil(3 / 2) steps each
            assert r["median_ms"] > 0 and r["hlo_table_copies"] == 0 and r["steps"] == 4
    assert out["target_system"] == "sparse_embed_native"
    assert out["agreement"]["sparse_embed_generic"] <= systems.AGREEMENT_TOLERANCE  # the kernels agree
    assert not peers.PEERS["flax"].missing()  # flax and optax are sparse_embed dependencies: always compared
    for key, peer in peers.PEERS.items():
        if not peer.missing():
            assert set(out["systems"][key]["steps"]) == set(peer.measurements), key
            assert all(r["median_ms"] > 0 and r["state_bytes"] > 0 for r in out["systems"][key]["steps"].values())
            assert out["agreement"][key] <= systems.AGREEMENT_TOLERANCE  # same forward and SGD update
        else:
            assert out["systems"][key]["status"].startswith("not installed") and not out["systems"][key]["steps"]
    bound = out["lower_bound"]
    assert all(ms > 0 for source in bound["ms"].values() for ms in source.values())
    rows = {(r["measurement"], r["system"]): r for r in out["comparison"]}
    assert ("train_sgd", "flax") in rows and ("forward", "sparse_embed_native") in rows
    adam = rows[("train_adam", "sparse_embed_native")]
    assert adam["vs_sgd"] == pytest.approx(adam["median_ms"] / rows[("train_sgd", "sparse_embed_native")]["median_ms"])
    w1 = [g for g in report.TARGETS if g.workload == "W1"]
    assert len(out["targets"]) == len(w1) + 1 and not any(t["applicable"] for t in out["targets"])
    for key in ("same_batch", "full_range"):
        assert out["vocab"][key]["ratio"] > 0 and out["vocab"][key]["kernel"] == "native"
    printed = capsys.readouterr().out
    assert "side by side" in printed and "vocabulary independence" in printed and "sparse_embed generic" in printed


def test_targets_are_judged_on_the_workload_they_belong_to():
    """A run of the small preset is judged on the small model's goals: every step <= 2x the SGD step."""
    rows = [{"measurement": m, "system": "sparse_embed_native", "vs_sgd": ratio}
            for m, ratio in (("train_sgd", 1.0), ("train_adagrad", 1.5), ("train_adam", 2.5))]
    got = {t["what"]: t["pass"] for t in report.targets(rows, None, "sparse_embed_native", "small")}
    assert got["train_adagrad / our SGD step"] is True and got["train_adam / our SGD step"] is False
    assert got["train_ftrl / our SGD step"] is None  # not measured: no verdict
    zipf = report.targets([], None, "sparse_embed_native", "W1 zipf 1.05")
    assert all(t["goal"] == 0.7 for t in zipf[:-1]) and all(t["applicable"] for t in zipf)


def test_bad_flags_are_refused():
    for argv in (["--kernels", "fast"], ["--preset", "huge"], ["--zipf", "0.5"], ["--optimizer", "lamb"],
                 ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            step.parse_args(argv)


def test_preprocess_benchmark_smoke(capsys):
    from benchmarks import preprocess

    out = preprocess.main(["--quick"])
    assert {(r["input"], r["devices"]) for r in out["rows"]} == {
        (i, d) for i in ("dense", "ragged") for d in (1, 8)}
    assert all(r["sparse_embed_s"] > 0 for r in out["rows"])
    assert "ratio" in capsys.readouterr().out


@pytest.mark.parametrize("mode", [["--in-process"], ["--repeats", "1", "--cache", "cold"]], ids=["in-process", "fresh"])
def test_checkpoint_benchmark_smoke(capsys, tmp_path, frozen_heap, mode):
    from benchmarks import checkpoint

    out = checkpoint.main(["--quick", "--dir", str(tmp_path), "--json", str(tmp_path / "ck.json"), *mode])
    (case,) = out["cases"]
    rounds = case.get("rounds", [case])  # fresh processes: one round per --repeats
    assert len(rounds) == 1 and rounds[0]["state_bytes"] == 100_000 * 64 * 4 * 2  # table + Adagrad accumulator
    assert all(rounds[0][k] > 0 for k in ("init_s", "save_s", "restore_s", "np_save_s", "np_load_s"))
    assert len(checkpoint.goals(rounds[0])) == 7 and (tmp_path / "ck.json").exists()
    assert "restore throughput / np.load" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [[], ["--new", "0.2", "--occupancy", "1"]], ids=["prefilled", "admitting"])
def test_raw_ids_benchmark_smoke(tmp_path, extra):
    from benchmarks import raw_ids

    out = raw_ids.main(["--tables", "2", "--rows", "4096", "--batch", "64", "--steps", "2", "--warmup", "1",
                        "--preprocess_reps", "1", "--malloc", "glibc", "--out", str(tmp_path / "r.json"), *extra])
    # 16 + the directory; with id_bits=40 (4096 rows: 256 buckets, so up to 40 bits) 4-byte keys
    assert "| train step (SGD), ms |" in out and "| map bytes per row | - | 16.25 | 12.25 |" in out
    assert "| train step, process CPU ms |" in out and "load average" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["new_ids"] == (0.2 if extra else 0.0)
    assert all(r[k][raw] > 0 for k in ("step_ratio", "step_cpu_ratio", "preprocess_ratio") for raw in ("raw", "raw40"))
    assert all(r["step_cpu_ms"][k] > 0 for k in ("static", "raw", "raw40")) and r["load_average"] >= 0


def _avx512() -> bool:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


@pytest.mark.skipif(shutil.which("g++") is None or not _avx512(), reason="needs g++ and an AVX-512 CPU")
def test_raw_ids_layouts_benchmark_smoke(tmp_path):
    """The C++ layout benchmark builds and runs at a small size; it checks every row each layout finds against
    the ids' rows itself (exit 1 on a wrong one), with rows in key order and shuffled."""
    src = pathlib.Path(__file__).parents[1] / "benchmarks" / "raw_ids_layouts.cc"
    exe = tmp_path / "layouts"
    subprocess.run(["g++", "-O1", "-march=native", "-std=c++17", str(src), "-o", str(exe)], check=True)
    for extra in ([], ["shuffled"]):
        out = subprocess.run([str(exe), "12", *extra], check=True, capture_output=True, text=True).stdout
        assert "2^12 slots, 3276 ids, 3276 queries" in out and "one line: touch" in out, out


def test_placement_benchmark_smoke(tmp_path):
    from benchmarks import placement

    out = placement.main(["--small", "6", "--large", "2", "--large_rows", "5000", "--wide_rows", "300", "--wide",
                          "--batch", "64", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "p.json")])
    assert "| train step, ms (median) |" in out and "The auto plan:" in out and "table (device" in out
    r = json.loads((tmp_path / "p.json").read_text())
    # the plan's estimate of its collectives is what the compiled step holds, for both plans
    assert r["estimated_bytes"] == pytest.approx(r["hlo_bytes"], abs=1)
    assert 0 < r["bytes_ratio"] < 1 and r["step_ms"]["auto"] > 0 and r["step_ms"]["auto, w row"] > 0


def test_serving_quant_benchmark_smoke(tmp_path):
    from benchmarks import serving_quant

    out = serving_quant.main([
        "--tables", "2", "--rows", "3000", "--dim", "16", "--batch", "64", "--ids", "4", "--reps", "2",
        "--delta-steps", "1,3", "--load-seconds", "1", "--demo-steps", "3", "--demo-batch", "128", "--threads", "2", "--deltas", "3",
        "--load-batch", "16", "--out", str(tmp_path / "s.json"),
        "--demo-args=--eval-batches 2 --users 2000 --user-rows 1000 --items 1000 --tags 200"])
    assert "| int8 |" in out and "torn reads" in out
    r = json.loads((tmp_path / "s.json").read_text())
    mem = r["w1"]["memory"]
    assert mem["int4"] < mem["int8"] < mem["bfloat16"] < mem["float32"] == 2 * 3000 * 16 * 4
    assert all(0 < r["demo"]["auc"][t] < 1 for t in serving_quant.DTYPES)
    assert set(r["w1"]["delta"]) == set(r["demo"]["delta"]) == {"1", "3"}
    assert 0 < r["w1"]["delta"]["1"]["bytes_ratio"] < r["w1"]["delta"]["3"]["bytes_ratio"] < 1
    assert r["demo"]["delta"]["3"]["apply_s"] > 0
    assert r["load"]["torn"] == 0 and r["load"]["lookups"] > 0 and r["load"]["final_seq"] == 3
