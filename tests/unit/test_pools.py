"""Pools of accelerators (issue #45 items 4-5): the pool file / run-file ``hardware:`` shape and
its refusals (`ray_dhp.planning.pools`), and the pool-aware recommender
(`ray_dhp.planning.pool_recommend`): memory checked per pool, the rankings what the cost model
implies."""

from pathlib import Path

import pytest

from ray_dhp.planning.devices import ACCELERATORS
from ray_dhp.planning.pools import load_pool_file, parse_pools
from ray_dhp.run_file import ConfigError, run_file_from_dict

ROOT = Path(__file__).resolve().parents[2]
OWN = {"memory_gib": 80.0, "peak_bf16_tflops": 1000, "link_gbs": 360, "internode_gbs": 45}


def test_example_pool_files_resolve_the_device_table():
    pools = {p.name: p for p in load_pool_file(str(ROOT / "examples/pools/h100x8_l40sx8.yaml"))}
    h, l = pools["h100"], pools["l40s"]
    assert h.accelerator == ACCELERATORS["h100"] and l.accelerator == ACCELERATORS["l40s"]
    assert (h.devices, l.devices, h.labels) == (8, 8, {"pool": "h100"})
    assert h.margin_gib == ACCELERATORS["h100"].margin_gib
    assert h.budget().usable_gib == pytest.approx(79.1 - h.margin_gib)
    hw = l.hardware(0.4, 2)
    assert (hw.peak_flops, hw.link_bw, hw.internode_bw, hw.gpus_per_node) == (362e12, 25e9, 11e9, 8)
    for name in ("l40s", "a100-40gb", "a100-80gb", "h100", "h200", "b200", "l4", "mi300x"):
        assert name in ACCELERATORS


def test_own_kinds_and_overrides():
    pools = parse_pools({"accelerators": {"mine": OWN},
                         "pools": {"a": {"accelerator": "mine", "devices_per_node": 4, "nodes": 2,
                                         "margin_gib": 3},
                                   "b": {**OWN, "memory_gib": 40, "devices_per_node": 2,
                                         "nodes": 1, "price_per_device_hour": 1.5},
                                   "c": {"accelerator": "h100", "link_gbs": 100,
                                         "devices_per_node": 8, "nodes": 1}}})
    a, b, c = pools
    assert (a.devices, a.margin_gib, a.accelerator.peak_bf16) == (8, 3.0, 1e15)
    assert (b.accelerator.memory_gib, b.price_per_device_hour) == (40.0, 1.5)
    assert c.accelerator.link_gbs == 100 and c.accelerator.memory_gib == 79.1


@pytest.mark.parametrize("data, key", [
    ({"pools": {"a": {"accelerator": "h100", "nodes": 1}}}, "pools.a.devices_per_node"),
    ({"pools": {"a": {"accelerator": "h100", "devices_per_node": 8, "nodes": 0}}}, "pools.a.nodes"),
    ({"pools": {"a": {"accelerator": "h100", "devices_per_node": 8, "nodes": 1, "prise": 1}}},
     "pools.a.prise"),
    ({"pools": {"a": {"accelerator": "h1000", "devices_per_node": 8, "nodes": 1}}},
     "pools.a.accelerator"),
    ({"pools": {"a": {"memory_gib": 80, "devices_per_node": 8, "nodes": 1}}}, "pools.a.accelerator"),
    ({"pools": {"a": {"accelerator": "h100", "devices_per_node": 8, "nodes": 1,
                      "margin_gib": 90}}}, "pools.a.margin_gib"),
    ({"pools": {"a": {"accelerator": "h100", "devices_per_node": 8, "nodes": 1,
                      "price_per_device_hour": "cheap"}}}, "pools.a.price_per_device_hour"),
    ({"accelerators": {"x": {"memory_gib": 8}}, "pools": {"a": {"accelerator": "x",
                                                              "devices_per_node": 1, "nodes": 1}}},
     "accelerators.x"),
    ({"pool": {}}, "pool file.pool"),
    ({}, "pools"),
])
def test_bad_pool_files_are_refused_naming_the_key(data, key):
    with pytest.raises(ValueError, match=f"^{key}"):
        parse_pools(data)


def test_run_file_hardware_section_is_validated_naming_the_key():
    hw = {"pools": {"big": {"accelerator": "h100", "devices_per_node": 8, "nodes": 1}}}
    assert run_file_from_dict({"hardware": hw}).pools()[0].name == "big"
    hw["pools"]["big"]["nodes"] = -1
    with pytest.raises(ConfigError, match=r"^hardware\.pools\.big\.nodes"):
        run_file_from_dict({"hardware": hw})
    with pytest.raises(ConfigError, match=r"hardware\.pool\b"):
        run_file_from_dict({"hardware": {"pool": {}}})


@pytest.fixture(scope="module")
def model():
    """A 7B VLM (published dims, no weights) and a bf16 workload: its LM cannot fit on two
    24 GiB devices, its vision tower can."""
    from ray_dhp.cli.plan import policy_of_run, settings_of
    from ray_dhp.models import load_model_config
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.cost_types import Workload

    rf = run_file_from_dict({"model": {"family": "qwen2_5_vl", "preset": "7b"},
                             "precision": "bf16",
                             "optim": {"activation_checkpointing": True,
                                       "global_batch_size": 4, "micro_batches": 2}})
    policy = policy_of_run(rf)
    config = load_model_config(rf.model_spec())
    w = Workload(4096, 512, 4, 2, settings_of(rf, "flash"), float(policy.state_bytes()),
                 policy=policy)
    return config, count_params(config), w


def _pools(cheap_tflops: float):
    return parse_pools({"pools": {
        "fast": {**OWN, "devices_per_node": 4, "nodes": 1, "price_per_device_hour": 10},
        "cheap": {**OWN, "memory_gib": 24, "peak_bf16_tflops": cheap_tflops,
                  "devices_per_node": 2, "nodes": 1, "price_per_device_hour": 0.1}}})


def test_pool_recommender_memory_and_rankings(model):
    from ray_dhp.planning.pool_recommend import recommend_pools

    config, counts, w = model
    pools = _pools(cheap_tflops=1000)  # as fast as "fast", 1/100 of its price, 24 GiB
    by_name = {p.name: p for p in pools}
    cands = recommend_pools(config, pools, w, counts=counts)
    ok = [c for c in cands if c.feasible]
    # memory: each group against its own pool's device less its margin
    for c in ok:
        for group, gib in c.memory_gib.items():
            assert gib * 2 ** 30 <= by_name[c.pools[group]].budget().usable_gib * 2 ** 30
        assert c.pools.get("text", c.pools.get("vision+text")) == "fast"  # 7B LM: not in 2x24 GiB
    assert any("on cheap" in c.reason for c in cands if not c.feasible)
    # prices: the devices each group uses x its pool's price
    for c in ok:
        topo = c.layout.topology()
        sizes = ({"vision+text": topo.world_size} if c.layout.placement == "collocated"
                 else {"vision": topo.vision.size, "text": topo.text.size})
        price = sum(n * by_name[c.pools[g]].price_per_device_hour for g, n in sizes.items())
        assert c.tokens_per_price == pytest.approx(c.tokens_per_s * 3600 / price)
    assert ok[0].tokens_per_s == max(c.tokens_per_s for c in ok)
    best_price = max(ok, key=lambda c: c.tokens_per_price)
    # what the model implies: the tower on the nearly free, equally fast pool frees the LM's
    # devices (no vision work left on them) for 1/400 of the price: it wins tokens/price
    fast_only = max((c for c in ok if "cheap" not in c.pools.values()),
                    key=lambda c: c.tokens_per_price)
    tower_off = max((c for c in ok if c.pools.get("vision") == "cheap"),
                    key=lambda c: c.tokens_per_price)
    assert tower_off.tokens_per_s > fast_only.tokens_per_s
    assert best_price.pools == {"vision": "cheap", "text": "fast"}
    frag = best_price.run_file_fragment(by_name)
    assert frag["placement"]["mode"] == "disjoint" and "labels" not in frag["placement"]


def test_a_slow_pool_is_left_out_when_tokens_per_s_rank(model):
    from ray_dhp.planning.pool_recommend import recommend_pools

    config, counts, w = model
    pools = _pools(cheap_tflops=1)  # 1/1000 of the fast pool's peak
    ok = [c for c in recommend_pools(config, pools, w, counts=counts) if c.feasible]
    assert "cheap" not in ok[0].pools.values()


def test_cli_plan_recommend_on_pools(tmp_path, capsys):
    import yaml

    from ray_dhp.cli import main

    own = {**OWN, "memory_gib": 8}
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"pools": {
        "big": {**own, "devices_per_node": 2, "nodes": 1, "price_per_device_hour": 2,
                "labels": {"accel": "big"}},
        "small": {**own, "devices_per_node": 1, "nodes": 1, "price_per_device_hour": 1,
                  "labels": {"accel": "small"}}}}))
    tiny = str(ROOT / "examples/tiny.yaml")
    assert main(["plan", tiny, "--recommend", "--pool", str(pool), "--vision-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "best by tokens/s" in out and "best by tokens per price unit" in out
    assert "labels: {" in out and "accel: small" in out
    run = yaml.safe_load(open(tiny))  # the same pools as the run file's hardware: section
    run["hardware"] = yaml.safe_load(pool.read_text())
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["plan", str(tmp_path / "run.yaml"), "--recommend", "--vision-tokens", "256"]) == 0
    assert capsys.readouterr().out.replace("(hardware:)", f"(--pool {pool})") == out
    assert main(["plan", tiny, "--recommend", "--pool", str(pool), "--gpus", "4"]) == 2
    assert "--gpus" in capsys.readouterr().err
    pool.write_text(yaml.safe_dump({"pools": {"big": {"accelerator": "h100", "nodes": 1}}}))
    assert main(["plan", tiny, "--pool", str(pool)]) == 2
    assert "pools.big.devices_per_node" in capsys.readouterr().err


def test_a_mixture_of_experts_lm_is_planned_with_expert_parallelism_on_pools():
    from ray_dhp import demo
    from ray_dhp.planning.cost_types import Workload
    from ray_dhp.planning.pool_recommend import recommend_pools

    pools = parse_pools({"pools": {"a": {**OWN, "devices_per_node": 4, "nodes": 1}}})
    cands = recommend_pools(demo.tiny_model_config("qwen3_vl_moe"), pools, Workload(256, 64, 4))
    assert {c.layout.text_ep for c in cands if c.feasible} >= {1, 2, 4}
    assert all(c.run_file_fragment({"a": pools[0]})["text"].get("expert_parallel", 1)
               == c.layout.text_ep for c in cands)
