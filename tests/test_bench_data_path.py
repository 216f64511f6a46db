"""tools/bench_data_path.py on the CPU: the entry's data path drained by an idle consumer, per worker count."""
import json

from tools import bench_data_path


def test_rows_per_worker_count(tmp_path):
    bench_data_path.main(["--model", "tiny", "--frames", "4", "--latent-size", "8x12", "--sparse-tile", "2,2,2",
                          "--workers", "0,1", "--batches", "4", "--device", "cpu", "--out", str(tmp_path)])
    doc = json.load(open(tmp_path / "bench_data_path.json"))
    assert [r["workers"] for r in doc["results"]] == [0, 1]
    for r in doc["results"]:
        assert r["batches"] >= 4 and 0 < r["min_ms"] <= min(r["ms_per_batch"], r["median_ms"]) <= r["max_ms"]
        assert r["ms_per_batch"] == sum(r["intervals_ms"]) / r["batches"]
        assert len(r["intervals_ms"]) == r["batches"]
    meta = doc["meta"]
    assert meta["tokens"] == 4 * 4 * 6 and meta["tile"] == [2, 2, 2] and meta["cpus"] >= 1
    table = [line.split("|")[1:-1] for line in (tmp_path / "bench_data_path.md").read_text().splitlines()]
    assert table[0][1].strip() == "ms per batch (mean)" and len({len(r) for r in table}) == 1   # header fits rows
    assert [float(r[1]) for r in table[2:]] == [round(r["ms_per_batch"], 1) for r in doc["results"]]
