"""tools/bench_dynamic_sp.py --smoke on the CPU: the JSON a GPU run writes, with both plans of each pack, per-rank
times and exchanged bytes (structure only: timings are never asserted in CI)."""
import json

from tools import bench_dynamic_sp


def test_smoke_writes_both_plans(tmp_path):
    out = bench_dynamic_sp.main(["--smoke", "--reps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_dynamic_sp.json").read_text()) == out
    assert out["what"].startswith("EMULATED") and set(out["link_gbps"]) == {"host", "nvlink"}
    assert [p["pack"].split(" ")[0] for p in out["packs"]] == ["wan-mix", "equal:4:96"]
    for pack, mode in ((p, m) for p in out["packs"] for m in ("ulysses", "ring")):
        uni, dyn = pack[mode]["uniform"], pack[mode]["dynamic"]
        assert set(uni["sizes"]) == {out["world"]} and len(uni["ranks"]) == len(dyn["ranks"]) == out["world"]
        assert sum(r["tokens"] for r in dyn["ranks"]) >= pack["tokens"]  # every token on some rank (plus padding)
        assert uni["exchanged_bytes"] > 0 and dyn["exchanged_bytes"] <= uni["exchanged_bytes"]
        for k in ("host", "nvlink"):
            assert abs(pack[mode][f"speedup_{k}"] - uni[f"step_ms_{k}"] / dyn[f"step_ms_{k}"]) < 1e-9
            assert dyn[f"step_ms_{k}"] == max(r["attention_ms"] + r["rest_ms"] + r[f"exchange_ms_{k}"]
                                              for r in dyn["ranks"])
    ring = out["packs"][0]["ring"]["uniform"]["exchanged_bytes"]
    assert ring > out["packs"][0]["ulysses"]["uniform"]["exchanged_bytes"]  # the ring moves k, v P-1 times
    assert set(out["packs"][1]["ulysses"]["dynamic"]["sizes"]) == {1}  # 4 equal clips, 4 ranks: one each
