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


def test_peak_report_retries_without_early_stop(monkeypatch):
    """A recorded step that dies with SystemError (checkpoint's early stop under the history, 2026-11-28) is recorded
    once more with the early stop off, and the report says so; a step that records on the first try keeps it on."""
    import torch

    from tools import memory_peak
    calls = []

    def fake_record(fn, device, early_stop=True):
        calls.append(early_stop)
        if early_stop and fail:
            raise SystemError("forward returned NULL without setting an exception")
        return [{"action": "alloc", "addr": 1, "size": 2**20, "frames": OURS}], 0

    monkeypatch.setattr(memory_peak, "record_step", fake_record)
    fail = True
    rep = memory_peak.peak_report(lambda: None, torch.device("cpu"))
    assert calls == [True, False] and rep["checkpoint_early_stop"] is False and rep["live_at_peak"][0]["mib"] == 1.0
    calls.clear()
    fail = False
    rep = memory_peak.peak_report(lambda: None, torch.device("cpu"))
    assert calls == [True] and rep["checkpoint_early_stop"] is True
