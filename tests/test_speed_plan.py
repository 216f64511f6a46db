"""The speed plan (megatron_sp_ext/speed_plan): every mode's prediction comes from the schedule objects the mode itself
builds and runs (a change to one moves the prediction), the timeline's overlap arithmetic, the links and the rate
table, --validate on the committed rows, --table, and auto's ranking."""
import dataclasses
import json
import os

import pytest

from megatron_sp_ext import modes
from megatron_sp_ext import speed_plan as sp
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.speed_plan import schedules
from megatron_sp_ext.speed_plan import table, validate
from megatron_sp_ext.speed_plan.__main__ import main
from megatron_sp_ext.sp.speed_plan.cluster import Probe
from megatron_sp_ext.sp.speed_plan.timeline import COMPUTE, Timeline
from megatron_sp_ext.sp import heads as sp_heads
from megatron_sp_ext.sp.ring import ring as ring_mod
from megatron_sp_ext.sp.ring import rotation, torus
from megatron_sp_ext.topology import mesh as mesh_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PB = sp.Problem(tokens=32768, heads=16)
CL = sp.Cluster(2, 4, sp.PRESETS["nvlink_large"], sp.nic(200))   # 2 machines x 4 GPUs
RING, TASP = modes.names(ring_variant=True, multi_ring=False)[0], modes.names(multi_ring=True)[0]
USP = modes.names(arrangement=True, ulysses_across=False)[0]
TAS = modes.names(arrangement=True, ulysses_across=True)[0]
TORUS = modes.names(mesh=True, arrangement=False)[0]
ULYSSES, HCMS = schedules.ulysses_mode(False), schedules.ulysses_mode(True)


def fb(setting, pb=PB, cl=CL):
    return sp.predict(pb, cl, setting).fwd_bwd_ms


# ---- every mode, from its own schedule
def test_every_mode_of_the_registry_is_planned():
    """Every non-auto mode of the registry has candidates on a 2 x 4 cluster, and each prediction is positive with
    its exchange's parts adding up (hidden + exposed = exchange)."""
    settings = sp.candidates(PB, CL)
    assert {s.mode for s in settings} == set(modes.names(auto=False))
    preds, refused = sp.predict_all(PB, CL, settings)
    assert not refused and len(preds) == len(settings)
    for p in preds:
        b = p.both
        assert 0 < p.fwd_ms < p.fwd_bwd_ms and b.kernel_ms > 0, p.setting
        assert b.exchange_ms > 0 and b.hidden_ms == pytest.approx(b.exchange_ms - b.exposed_ms), p.setting
    with pytest.raises(SPConfigError, match="auto"):
        sp.predict(PB, CL, sp.Setting("auto"))


def test_ulysses_bytes_come_from_head_layout():
    """Plain Ulysses' forward exchange on one 4-GPU machine: q|k|v in and out, each 3/4 of a rank's tensors, over the
    class link: the prediction's exchange time is exactly those bytes over the link."""
    cl = sp.Cluster(1, 4, sp.Link(100.0, 0.0, 1.0), sp.Link(1.0))
    p = sp.predict(PB, cl, sp.Setting(ULYSSES))
    tensor = PB.tokens // 4 * PB.heads * PB.head_dim * 2   # one rank's q (bytes)
    per_exchange = {"qkv": 3 * tensor * 3 / 4, "o": tensor * 3 / 4}
    assert p.fwd.exchange_ms == pytest.approx(sum(per_exchange.values()) / 100e6)


def test_head_layout_change_moves_ulysses(monkeypatch):
    """HCMS reads its chunks from sp.heads.head_layout: a layout of one chunk less (what the mode would then run)
    changes the prediction, to plain Ulysses' time; the chunk count of a setting changes it too."""
    base = fb(sp.Setting(HCMS, 2))
    assert fb(sp.Setting(ULYSSES)) != base
    real = sp_heads.head_layout
    monkeypatch.setattr(sp_heads, "head_layout", lambda h, kv, w, c=1, *a: real(h, kv, w, max(c - 1, 1)))
    assert fb(sp.Setting(HCMS, 2)) == pytest.approx(fb(sp.Setting(ULYSSES))) != base


def test_ring_steps_and_transfers_move_the_ring(monkeypatch):
    """The ring's time is its plan's: twice the calls per step (RingPlan.items), twice the rows per transfer
    (RingPlan.transfer) or no dK|dV partials home (rotation.home_ops) each move the prediction."""
    one = sp.Cluster(1, 8, sp.PRESETS["nvlink_large"], sp.nic(200))   # NVLink: the kernels bound each step
    base = fb(sp.Setting(RING), cl=one)
    items, transfer = ring_mod.RingPlan.items, ring_mod.RingPlan.transfer
    monkeypatch.setattr(ring_mod.RingPlan, "items", lambda self, s, d: items(self, s, d) * 2)
    assert fb(sp.Setting(RING), cl=one) > base * 1.5
    monkeypatch.setattr(ring_mod.RingPlan, "items", items)
    monkeypatch.setattr(ring_mod.RingPlan, "transfer", lambda self, s, r=None: [
        (k, p, row, 2 * n) for k, p, row, n in transfer(self, s, r)])
    slow = sp.predict(PB, CL, sp.Setting(RING))
    monkeypatch.setattr(ring_mod.RingPlan, "transfer", transfer)
    assert slow.both.exchange_ms > sp.predict(PB, CL, sp.Setting(RING)).both.exchange_ms
    home = sp.predict(PB, CL, sp.Setting(RING)).bwd.exchange_ms
    monkeypatch.setattr(rotation, "home_ops", lambda plan, s, r=None: [])
    assert sp.predict(PB, CL, sp.Setting(RING)).bwd.exchange_ms < home


def test_tasp_reads_the_routing_tables(monkeypatch):
    """TASP's concurrent rings come from the routing tables build_ring_plan uses: with one ring instead of P-1 its
    prediction becomes the ring's; across machines its P-1 rings spread the K|V block over more links than one ring."""
    assert fb(sp.Setting(TASP)) != fb(sp.Setting(RING))
    monkeypatch.setattr(ring_mod, "routing_tables", ring_mod._single_ring)
    assert fb(sp.Setting(TASP)) == pytest.approx(fb(sp.Setting(RING)))


def test_mesh_grid_change_moves_usp_and_tas(monkeypatch):
    """USP and TAS read their groups from topology.mesh.mesh_grid: TAS's grid given to USP gives TAS's time."""
    tas = fb(sp.Setting(TAS, 1, RING, "", 4))
    usp = fb(sp.Setting(USP, 1, RING, "", 4))
    assert tas != usp
    real = mesh_mod.mesh_grid
    monkeypatch.setattr(mesh_mod, "mesh_grid", lambda topo, h, arr="auto", u=None, names=None: real(topo, h, TAS, u))
    assert fb(sp.Setting(USP, 1, RING, "", 4)) == pytest.approx(tas)


def test_torus_stages_move_torus(monkeypatch):
    """Torus' time comes from torus.torus_schedule: stages that move nothing leave its attention and drop its
    exchanges."""
    st = sp.Setting(TORUS, 1, RING, TAS, 4)
    base = sp.predict(PB, CL, st)
    real = torus.torus_schedule

    def silent(T, t):
        s = real(T, t)
        quiet = lambda stages: tuple(dataclasses.replace(x, moves="", dst=(), src=()) for x in stages)  # noqa: E731
        return dataclasses.replace(s, forward=quiet(s.forward), backward=quiet(s.backward))
    monkeypatch.setattr(torus, "torus_schedule", silent)
    quiet = sp.predict(PB, CL, st)
    assert quiet.fwd.exchange_ms < base.fwd.exchange_ms and quiet.fwd.kernel_ms == pytest.approx(base.fwd.kernel_ms)


def test_torus_schedule_is_what_the_function_runs():
    """The stages' transfers pair up: whatever rank t sends to d at a stage, d receives from t at the same stage."""
    for T in (1, 2, 3, 4):
        scheds = [torus.torus_schedule(T, t) for t in range(T)]
        for t, s in enumerate(scheds):
            assert len(s.forward) == 2 * T if T > 1 else len(s.forward) == 1
            for kind in ("forward", "backward"):
                for i, stage in enumerate(getattr(s, kind)):
                    for d in stage.dst:
                        assert t in getattr(scheds[d], kind)[i].src, (T, t, kind, i)


# ---- the parts
def test_timeline_overlap_and_hidden_share():
    tl = Timeline()
    k = tl.add(COMPUTE, 10.0)
    tl.add("comm", 4.0, kind="exchange", hidden=0.5)   # beside the kernel: 2 ms of it add
    tl.add(COMPUTE, 1.0, [k])
    r = tl.run()
    assert r.total_ms == pytest.approx(11.0 + 2.0) and r.exchange_ms == 4.0 and r.hidden_ms == pytest.approx(2.0)
    tl = Timeline()
    x = tl.add("comm", 4.0, kind="exchange", hidden=0.5)
    tl.add(COMPUTE, 10.0, [x])   # waits: nothing overlaps, nothing hidden
    r = tl.run()
    assert r.total_ms == pytest.approx(14.0) and r.hidden_ms == 0.0 and r.exposed_ms == 4.0


def test_probe_time_and_the_class_model():
    p = Probe(0, 1, ((1e6, 0.2), (9e6, 1.0)))
    assert p.ms(5e6) == pytest.approx(0.6) and p.ms(1e5) == pytest.approx(0.2)
    assert p.ms(17e6) == pytest.approx(1.8)              # beyond: along the last segment (10 GB/s marginal)
    flat = Probe(1, 0, ((1e6, 0.10), (9e6, 0.11)))        # latency-bound rows: the largest row's average rate
    assert flat.ms(90e6) == pytest.approx(0.11 + 81e6 / (9e6 / 0.11))
    cl = sp.Cluster(2, 2, sp.Link(100.0), sp.Link(10.0, 0.01))
    ms, hidden = cl.exchange_ms({0: {1: 1e8, 2: 1e8}})
    assert ms == pytest.approx(0.01 + 1e8 / 10e6) and hidden == 1.0


def test_cluster_from_a_committed_probe():
    with open(os.path.join(ROOT, "results/2026-11-28_h200x4_2010/call5/i68_emu22/emu22.json")) as f:
        probe = json.load(f)["meta"]["links_probe"]["4"]
    cl = sp.Cluster.from_probe(probe, "emu2", 4)
    assert (cl.machines, cl.per_machine) == (2, 2)
    assert {(p.intra, p.inter) for p in cl.probes} == {(1, 2), (1, 0), (0, 1)}
    assert cl.inter.gbps == pytest.approx(10.395, rel=1e-3)
    with pytest.raises(SPConfigError, match="emu"):
        sp.Cluster.from_probe(probe, "nvlinks", 4)


def test_rate_table_rows_and_sources():
    rates = sp.package_rates()
    for device in rates.devices():
        for kind in ("dense", "block_sparse"):
            for kernel, rows in rates.table["devices"][device][kind].items():
                assert rows and all(os.path.exists(os.path.join(ROOT, r["source"])) for r in rows), (device, kernel)
    fwd, bwd = rates.call_ms("H200", "fa4", sp.Call(32768, 32768, 40))
    assert 25 < fwd < 45 and 60 < bwd < 120          # the measured rows' range (results/2026-11-25_h200_fa4)
    half = rates.call_ms("H200", "fa4", sp.Call(32768, 32768, 40, density=0.1))
    assert half[0] < fwd / 5
    with pytest.raises(SPConfigError, match="B300"):
        rates.call_ms("B300", "fa4", sp.Call(1024, 1024, 1))


# ---- validation, table, CLI
@pytest.fixture(scope="module")
def summary():
    return validate.validate(os.path.join(ROOT, "results"))


def test_validate_the_committed_rows(summary):
    """One line per validated row, the final line ``N rows, median |error| X%, max Y%`` (forward+backward), the
    forward's summary before it; forward+backward within the bounds (median <= 10%, every mode's worst <= 25%)."""
    last = summary.lines[-1]
    n, med, top, worst = validate.Summary.stats(summary.fwd_bwd)
    assert last == f"{n} rows, median |error| {med:.1%}, max {top:.1%}" and n >= 100
    assert summary.lines[-2].startswith("forward: ")
    assert sum(1 for line in summary.lines if "predicted" in line) == n
    assert summary.passes(summary.fwd_bwd), worst
    assert validate.Summary.stats(summary.fwd)[1] <= validate.MEDIAN_BOUND


@pytest.mark.xfail(strict=True, reason="the forward of two modes misses the 25% bound on committed rows: the ring on "
                   "host links (causal 64K on 2026-11-28: -28%, the forward's exchange ran after the attention kernel; "
                   "timed again on 2026-11-29: -2.8%, overlapped; rows are never dropped) and TASP on the emulated 2 x 2 (+28%); nothing is "
                   "tuned to them (docs/choosing_a_mode.md)")
def test_validate_exits_0_on_the_committed_rows(summary):
    assert summary.ok


def test_validate_gate_and_a_new_row(tmp_path):
    """A new bench_cp row (no probe of its own, as bench_cp writes them) comes in: it is predicted from the committed
    probe of its regime (validate.FALLBACK), one line; at its measured time the gate passes (exit 0), a row 2x off
    fails it (exit 1)."""
    src = os.path.join(ROOT, "results/2026-11-28_h200x4_2010/call6/i68_cp2_nv/bench_cp_nvlink_P2.json")
    with open(src) as f:
        doc = json.load(f)
    doc["rows"] = doc["rows"][:1]
    doc["rows"][0]["modes"] = {ULYSSES: doc["rows"][0]["modes"][ULYSSES]}
    path, _ = validate.FALLBACK["nvlink", 2]
    with open(os.path.join(ROOT, "results", path)) as f:
        probe = {"meta": {"links_probe": json.load(f)["meta"]["links_probe"]}}   # the probe only, no rows
    (tmp_path / os.path.dirname(path)).mkdir(parents=True)
    (tmp_path / path).write_text(json.dumps(probe))
    day = tmp_path / "2026-12-01_h200x2"
    day.mkdir()
    (day / "bench_cp_nvlink_P2.json").write_text(json.dumps(doc))
    out = validate.validate(str(tmp_path))
    assert out.ok and [line for line in out.lines if "predicted" in line][0].startswith(ULYSSES)
    assert out.lines[-1].startswith("1 rows") and main(["--validate", "--results", str(tmp_path)]) == 0
    doc["rows"][0]["modes"][ULYSSES]["fwd_bwd_ms"] *= 2
    (day / "bench_cp_nvlink_P2.json").write_text(json.dumps(doc))
    assert main(["--validate", "--results", str(tmp_path)]) == 1


def test_table_into_a_doc(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# guide\n\ntext\n")
    rows = table.run_table(str(doc), str(tmp_path / "plot.png"), devices=("H200",), nics=(400,), max_machines=2)
    text = doc.read_text()
    assert table.BEGIN in text and "| wan-14b | 75,600 | dense | 2x8 |" in text and (tmp_path / "plot.png").exists()
    assert len(rows) == 2 * 2 * 3 * 2 and all(r.best.fwd_bwd_ms <= (r.usp or r.best).fwd_bwd_ms for r in rows)
    table.run_table(str(doc), str(tmp_path / "plot.png"), devices=("H200",), nics=(400,), max_machines=1)
    assert doc.read_text().count(table.BEGIN) == 1   # replaced, not appended


def test_volume_from_the_schedules_at_4x8():
    """TAS moves half USP's bytes between machines at 4 x 8 (P_u 8), counted from the schedules; topology/volume.py's
    equations give the same ratio and count per machine (8 GPUs) what the schedules count per GPU."""
    rows = {(a, u): (mib, eq) for a, u, mib, eq in table.volume_rows()}
    usp, tas = rows[USP, 8], rows[TAS, 8]
    assert tas[0] == pytest.approx(usp[0] / 2) and tas[1] == pytest.approx(usp[1] / 2)
    assert usp[1] == pytest.approx(8 * usp[0]) and tas[1] == pytest.approx(8 * tas[0])


def test_cli(capsys):
    assert main(["--tokens", "65536", "--heads", "8", "--machines", "2", "--gpus-per-machine", "2"]) == 0
    out = capsys.readouterr().out
    assert f"\n{ULYSSES} " in out and "fwd+bwd" in out and TORUS in out
    assert main(["--tokens", "0"]) == 2 and "--tokens=0" in capsys.readouterr().err
    assert main(["--device", "B300"]) == 2 and "B300" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


# ---- auto's ranking
def test_rank_modes_and_separable():
    ranking = sp.rank_modes(PB, CL)
    times = [ms for _, ms in ranking]
    assert times == sorted(times) and len(ranking) == len(sp.candidates(PB, CL))
    assert sp.separable(ranking, 0.0)[0] == ranking[0] and len(sp.separable(ranking, 10.0)) == len(ranking)
    assert sp.separable([], 0.1) == []
    fake = [(sp.Setting(RING), 10.0), (sp.Setting(ULYSSES), 10.4), (sp.Setting(TASP), 12.0)]
    assert [s.mode for s, _ in sp.separable(fake, 0.05)] == [RING, ULYSSES]
    only = sp.rank_modes(PB, CL, [sp.Setting(RING), sp.Setting(ULYSSES)])
    assert {s.mode for s, _ in only} == {RING, ULYSSES}


def test_auto_ranker_narrows_across_machines(caplog):
    """Across machines the ranker keeps what the plan cannot separate (the fastest and those within the margin),
    logs the ranking, what it timed, the pick and its predicted time once; inside one machine it keeps everything."""
    from megatron_sp_ext.sp.speed_plan.auto import AutoRanker, settings_for, shape_of
    steps = {HCMS: "u", RING: "r", TASP: "t"}
    shape = shape_of((1, 4096, 16, 128), (1, 4096, 16, 128), "bshd", 8, False, "auto", None, "cpu")
    assert (shape.tokens, shape.heads, shape.device) == (32768, 16, "cpu")
    assert [s.chunks for s in settings_for(HCMS, shape, 8)] == [1, 2] and settings_for(RING, shape, 8) == [
        sp.Setting(RING)]
    ranker = AutoRanker(margin=0.0)
    kept, report = ranker.narrow(steps, shape, None)
    assert kept is steps and report(RING) == RING
    kept, report = ranker.narrow(steps, shape, CL)
    ranking = ranker.rankings[next(iter(ranker.rankings))]
    assert list(kept) == [ranking[0][0].mode] and len(ranking) == 3
    wide = AutoRanker(margin=10.0)
    assert list(wide.narrow(steps, shape, CL)[0]) == list(steps)
    import torch   # a 90% block mask: ranked at its density, keyed by its shape (the next mask reuses the ranking)
    mask = torch.rand(1, 256, 256) < 0.1
    tiled = shape_of((1, 4096, 16, 128), (1, 4096, 16, 128), "bshd", 8, False, "auto",
                     {"block_mask": mask, "block_size": 128}, "cpu")
    wide.narrow(steps, tiled, CL, mask)
    dense_ms, sparse_ms = (dict((st.mode, ms) for st, ms in wide.rankings[k]) for k in wide.rankings)
    assert all(sparse_ms[m] < dense_ms[m] for m in dense_ms) and len(wide.rankings) == 2
    wide.narrow(steps, tiled, CL, torch.ones(1, 256, 256, dtype=torch.bool))
    assert len(wide.rankings) == 2
    with caplog.at_level("INFO", logger="megatron_sp_ext"):
        assert report(RING) == RING and report(RING) == RING
    said = [r.getMessage() for r in caplog.records if "speed plan" in r.getMessage()]
    assert len(said) == 1 and "2 x 4 GPUs" in said[0] and f"auto picked {RING}" in said[0]


def test_rate_table_is_rebuilt_from_its_sources(monkeypatch):
    """The package's kernel-rate table is exactly tools/bench_kernels.py --rates-from of the committed JSONs it names."""
    from tools.bench_kernels import rates_table
    committed = sp.package_rates().table
    sources = list(dict.fromkeys(r["source"] for dev in committed["devices"].values() for kind in ("dense",
                                 "block_sparse") for rows in dev[kind].values() for r in rows))
    monkeypatch.chdir(ROOT)
    assert rates_table(sources)["devices"] == committed["devices"]


def test_validate_shows_te_p2p_beside_rows_of_jobs_that_timed_it():
    """#84: the ring's host-link outlier reads against TE's ring of the same job (61.3 ours, 47.7 TE, 44.1 planned)."""
    from megatron_sp_ext.speed_plan.validate import validate
    lines = [ln for ln in validate(os.path.join(ROOT, "results")).lines
             if ln.startswith("ring ") and "2026-11-28_h200x2_1345/call6" in ln and "65536 causal host" in ln]
    assert len(lines) == 1 and "TE p2p in the same job: fwd 47.69, fwd+bwd 152.65 ms" in lines[0], lines
