"""tools/memory_peak.py's replay of an allocator trace: the peak moment, the blocks alive then grouped by the first
frame outside torch, frees counted once, blocks from before the window lowering the total."""
from __future__ import annotations

from tools.memory_peak import peak_from_trace, site

OURS = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "f"},
        {"filename": "/repo/megatron_sp_ext/sp/ulysses/function.py", "line": 58, "name": "forward"}]
DIFF = [{"filename": "/x/site-packages/diffusers/models/attention_dispatch.py", "line": 9, "name": "attn"}]


def test_site_skips_torch_frames():
    assert site(OURS) == "megatron_sp_ext/sp/ulysses/function.py:58 forward"
    assert site(DIFF) == "diffusers/models/attention_dispatch.py:9 attn"
    assert site([]) == "?"


def test_peak_and_live_blocks():
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": OURS},
             {"action": "alloc", "addr": 2, "size": 50, "frames": DIFF},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "free_completed", "addr": 1, "size": 100},    # the same free: not counted twice
             {"action": "alloc", "addr": 3, "size": 60, "frames": OURS},
             {"action": "free_completed", "addr": 9, "size": 500},    # allocated before the window
             {"action": "alloc", "addr": 4, "size": 400, "frames": DIFF}]
    rep = peak_from_trace(trace, base_bytes=1000)
    assert rep["peak_above_base_bytes"] == 150 and rep["peak_event"] == 1
    assert {r["site"]: r["bytes"] for r in rep["live_at_peak"]} == {
        "megatron_sp_ext/sp/ulysses/function.py:58 forward": 100, "diffusers/models/attention_dispatch.py:9 attn": 50}
    assert rep["live_at_peak"][0]["bytes"] == 100 and rep["base_bytes"] == 1000


def test_reused_address_after_free():
    trace = [{"action": "alloc", "addr": 1, "size": 10, "frames": OURS},
             {"action": "free_requested", "addr": 1, "size": 10},
             {"action": "alloc", "addr": 1, "size": 30, "frames": DIFF},
             {"action": "free_completed", "addr": 1, "size": 30}]
    rep = peak_from_trace(trace)
    assert rep["peak_above_base_bytes"] == 30 and [r["bytes"] for r in rep["live_at_peak"]] == [30]
