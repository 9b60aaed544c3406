"""The placement simulator's maths: specs, step and TTFT predictions, calibration (no processes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agent.wire.ids import NodeId
from webapp.fleet.placement import Placement
from webapp.fleet.simulate import (
    GB,
    SPECS,
    Calibration,
    Fleet,
    ModelSpec,
    SimNode,
    calibrate,
    calibrate_one_hop,
    fleet_from_dict,
    loopback_fleet,
    main,
    predict_route,
    simulate,
    spec_from_dict,
)


def toy(n: int = 4, layer: int = 1000, active: int = 400, head: int = 500, dim: int = 8) -> ModelSpec:
    return ModelSpec(
        name="toy",
        layer_bytes=(layer,) * n,
        active_bytes=(active,) * n,
        state=((),) * n,
        first_bytes=head,
        last_bytes=head,
        head_active_bytes=head,
        boundary_dim=dim,
    )


def test_a_decode_step_is_compute_plus_one_round_trip_and_overhead_per_hop() -> None:
    cal = Calibration(layer_step_ms=2.0, head_step_ms=3.0, hop_overhead_ms=1.5)
    fleet = replace(loopback_fleet(cal, 2, latency_ms=10.0), nodes=tuple(
        replace(n, bandwidth_gbps=1e9) for n in loopback_fleet(cal, 2, 10.0).nodes))  # fmt: skip
    hops, step, _ = predict_route(toy(), fleet, [Placement(NodeId("loopback-0"), 0, 1),
                                                 Placement(NodeId("loopback-1"), 1, 4)])  # fmt: skip
    assert [h.compute_ms for h in hops] == [2.0, 3 * 2.0 + 3.0]
    assert step == pytest.approx(2.0 + 9.0 + 2 * (2 * 10.0 + 1.5), rel=1e-6)


def test_link_bandwidth_charges_the_seam_and_the_frame_bytes() -> None:
    node = SimNode("a", GB, latency_ms=0.0, bandwidth_gbps=0.001, layer_step_ms=0.0, head_step_ms=0.0)
    fleet = Fleet("slow link", (node, replace(node, name="b")), hop_overhead_ms=0.0)
    spec = toy(dim=1000)
    hops, _, _ = predict_route(spec, fleet, [Placement(NodeId("a"), 0, 2), Placement(NodeId("b"), 2, 4)])
    # hop a: 4 bytes of ids in, 4000 bytes of f32 seam (the default) out, two frame envelopes; 1 Mb/s
    assert hops[0].network_ms == pytest.approx((4 + 4000 + 320) * 8 / 1e6 * 1e3)


def test_memory_bound_layer_time_counts_the_used_experts_and_the_state_at_the_context() -> None:
    from agent.artifacts.archs import StatePart

    spec = replace(toy(), state=((StatePart("k", 100),),) * 4)
    node = SimNode("a", GB, mem_bandwidth_gbs=1.0, efficiency=0.5)
    # 400 active bytes + 100 elements x 2 bytes x 1000 tokens, at 0.5 GB/s
    assert node.layer_ms(spec, 0, 1000) == pytest.approx((400 + 200_000) / 0.5e9 * 1e3)


def test_calibration_splits_layers_head_and_overhead() -> None:
    cal = calibrate([15, 15], [15.0, 25.0], step_ms=50.0)
    assert cal == Calibration(1.0, 10.0, 5.0)
    with_delay = calibrate(
        [10, 10, 10], [10.0, 10.0, 20.0], step_ms=3 * (2 * 5.0 + 2.0) + 40.0, latency_ms=5.0
    )
    assert with_delay.hop_overhead_ms == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least two hops"):
        calibrate([30], [30.0], 40.0)


def test_a_calibrated_loopback_prediction_reproduces_its_own_measurement() -> None:
    cal = calibrate([15, 15], [15.0, 25.0], step_ms=50.0)
    fleet = loopback_fleet(cal, 2, 0.0)
    _, step, _ = predict_route(toy(n=30), fleet, [Placement(NodeId("loopback-0"), 0, 15),
                                                  Placement(NodeId("loopback-1"), 15, 30)])  # fmt: skip
    assert step == pytest.approx(50.0, abs=0.01)  # the frame bytes at 10 Gb/s are a few microseconds


def test_one_hop_calibration_splits_its_compute_by_the_bytes_read() -> None:
    # 4 layers reading 400 bytes each and a head reading 400: a fifth of the compute is the head
    cal = calibrate_one_hop(toy(head=400), compute_ms=10.0, step_ms=13.0, latency_ms=1.0)
    assert cal == Calibration(pytest.approx(2.0), pytest.approx(2.0), pytest.approx(1.0))


def test_a_links_bucket_lets_small_frames_through_and_chain_mode_crosses_the_same_links() -> None:
    cal = Calibration(layer_step_ms=0.0, head_step_ms=0.0, hop_overhead_ms=0.0)
    spec = toy(dim=1000)  # 4000-byte seams
    plan = [Placement(NodeId("loopback-0"), 0, 2), Placement(NodeId("loopback-1"), 2, 4)]
    fleet = loopback_fleet(cal, 2, 5.0, bandwidth_gbps=0.001, burst_bytes=1000)
    hops, star, _ = predict_route(spec, fleet, plan)
    # hop 0: the ids' frame fits the bucket; the seam's frame waits for its bytes beyond it, at 1 Mb/s
    assert hops[0].network_ms == pytest.approx(2 * 5.0 + (4000 + 160 - 1000) * 8 / 1e6 * 1e3)
    _, chain, _ = predict_route(spec, fleet, plan, mode="chain")
    assert chain == pytest.approx(star)  # the seam crosses both hops' links either way; tokens fit
    with pytest.raises(ValueError, match="mode"):
        predict_route(spec, fleet, plan, mode="ring")


@pytest.mark.parametrize("path", sorted((SPECS / "models").glob("*.json")), ids=lambda p: p.stem)
def test_every_model_spec_describes_its_layers_and_fits_its_published_size(path) -> None:  # noqa: ANN001
    d = json.loads(path.read_text())
    s = spec_from_dict(d, "Q8_0")
    assert s.n_layers == d["n_layers"]
    params = (sum(s.layer_bytes) + s.first_bytes + s.last_bytes) * 8 / 8.5
    published = d.get("published_params") or {"deepseek4": 284e9, "glm-dsa": 744e9}.get(d["architecture"])
    if published is None:
        published = 35e9 if "35B" in d["name"] else 397e9
    assert abs(params - published) / published < 0.06, params


def test_glm_places_with_its_dense_prefix_and_groups_and_deepseek_carries_four_streams() -> None:
    glm = spec_from_dict(json.loads((SPECS / "models" / "glm-5.2.json").read_text()), "Q4_K_M")
    assert glm.leading_dense == 3 and (2, 6) in glm.groups
    fleet = fleet_from_dict(json.loads((SPECS / "fleets" / "cpu-16x64gb.json").read_text()))
    p = simulate(glm, fleet, context=8192)
    assert not p.error and p.hops[0].layer_end >= 6
    assert all(glm.shape().cut_ok(h.layer_start) for h in p.hops)
    dsv4 = spec_from_dict(json.loads((SPECS / "models" / "deepseek-v4-flash.json").read_text()), "Q4_K_M")
    assert dsv4.boundary_dim == 4 * 4096 and dsv4.seam_bytes_per_token(1) == 4 * 4096 * 4 + 4
    assert dsv4.seam_bytes_per_token(10) == 4 * 4096 * 4  # no hash-routed layer downstream


def test_a_fleet_too_small_is_reported_with_the_planners_reason() -> None:
    glm = spec_from_dict(json.loads((SPECS / "models" / "glm-5.2.json").read_text()), "Q8_0")
    fleet = fleet_from_dict(json.loads((SPECS / "fleets" / "gpu-8x24gb.json").read_text()))
    p = simulate(glm, fleet)
    assert "cannot hold the model" in p.error and p.decode_tok_s == 0


def test_the_cli_prints_a_plan_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(SPECS / "models" / "ornith-1.0-35b-a3b.json")
    assert main(["plan", model, str(SPECS / "fleets" / "gpu-4x80gb.json"), "--context", "131072"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "" and out["decode_tok_s"] > 0 and len(out["hops"]) == 4


def test_the_audit_cli_writes_a_page_that_names_the_command_that_made_it(tmp_path: Path) -> None:
    from webapp.fleet.audit import main as audit

    spec, out = str(SPECS / "models" / "glm-5.2.json"), tmp_path / "glm.md"
    assert audit([spec, "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("# Audit: GLM-5.2") and f"python -m webapp.fleet.audit {spec} --out" in page
    assert "## Placement on sample fleets (predicted)" in page
