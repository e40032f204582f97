"""``ray-dhp plan --recommend --pool POOL.yaml`` (or a run file's ``hardware:`` section): the
placements of the module groups on the pools the cost model prefers, by tokens/s and by tokens
per price unit (`ray_dhp.planning.pool_recommend`)."""

from __future__ import annotations

from collections import Counter

from ray_dhp.cli.schema import ConfigError

TOP = 3


def pools_of(rf, pool_file=None):
    """``(pools, where)``: the pools of ``--pool`` (over the run file's) or of the run file's
    ``hardware:`` section; ``(None, None)`` without either. ConfigError naming the key."""
    from ray_dhp.planning.pools import load_pool_file

    if pool_file is not None:
        try:
            return load_pool_file(pool_file), f"--pool {pool_file}"
        except ValueError as e:
            raise ConfigError(str(e)) from None
    pools = rf.pools()
    return (pools, "hardware:") if pools else (None, None)


def pools_lines(pools, where: str) -> list:
    return [f"pools ({where}):"] + [f"  {p.describe()}" for p in pools]


def _cost_per_million(c) -> str:
    return "-" if c.price_per_hour is None else f"{c.price_per_hour / (c.tokens_per_s * 3600) * 1e6:.3f}"


def _row(i, c, pools) -> str:
    lay = c.layout
    groups = " | ".join(f"{g} on {p} ({_size(c, g)})" for g, p in c.pools.items())
    text = f"tp{lay.text_tp}{'+sp' if lay.text_sp else ''} x dp{lay.text_dp}"
    mem = ", ".join(f"{g} {gib:.1f} GiB ({c.headroom[g]:.0%})" for g, gib in c.memory_gib.items())
    tpp = "-" if c.tokens_per_price is None else f"{c.tokens_per_price:,.0f}"
    return (f"{i:>3}  {groups:<38} {lay.schedule:<10} {f'sp{lay.vision_sp} x dp{lay.vision_dp}':<11}"
            f" {text:<13} {_zero(lay):<4} {c.step_s:8.4g} {c.tokens_per_s:10,.0f} {tpp:>12}"
            f" {_cost_per_million(c):>9}  {mem}")


def _size(c, group) -> int:
    topo = c.layout.topology()
    return topo.world_size if group == "vision+text" else getattr(topo, group).size


def _zero(lay) -> str:
    return "/".join(str(m.zero_stage) for m in lay.topology().modules)


def _snippet(c, pools) -> list:
    """The candidate's run-file fragment, one line per section (YAML flow style)."""
    import yaml

    frag = c.run_file_fragment({p.name: p for p in pools})
    lines = (yaml.safe_dump({k: v}, sort_keys=False, default_flow_style=True, width=200).strip()
             for k, v in frag.items())
    return ["     " + line[1:-1] for line in lines]  # without the outer braces


def pool_recommend_text(rf, pools, where: str, *, micro_batches, vision_tokens: list,
                        text_tokens: int, attention: str = "flash", efficiency: float = 0.4,
                        vision_mix=None) -> tuple:
    """(report, ok): the best `TOP` placements on ``pools`` by tokens/s and by tokens per price
    unit, each with its groups' pools, degrees, per-rank memory and headroom and its run-file
    fragment (``placement.labels`` from the pools' labels); ``ok`` is False when none fits."""
    from ray_dhp.cli.plan import _num
    from ray_dhp.cli.recommend import _workload_line, build_workload
    from ray_dhp.planning.pool_recommend import recommend_pools

    if rf.audio is not None:
        raise ConfigError("--pool: the pool planner places vision and text groups; a run file "
                          "with an audio: section is not planned on pools yet (plan it with "
                          "--recommend and --device).")
    config, counts, w, _, _, _ = build_workload(
        rf, micro_batches=micro_batches, vision_tokens=vision_tokens, text_tokens=text_tokens,
        attention=attention, budget=None, vision_mix=vision_mix)
    cands = recommend_pools(config, pools, w, efficiency, counts=counts)
    ok = [c for c in cands if c.feasible]
    s = w.settings
    out = pools_lines(pools, where) + [
        f"model: {config.model_type} (vision {_num(counts.vision)}, text {_num(counts.text)} "
        "parameters)",
        _workload_line(w.vision_tokens, text_tokens, vision_tokens, vision_mix)
        + f"; global batch {w.global_batch_size} = {w.micro_batches} micro-batch(es) of "
        f"{w.micro_batch_size}; {s.dtype_bytes}-byte activations, {attention} attention, "
        f"checkpointing {'on' if s.checkpointing else 'off'}, {w.policy.name} state "
        f"({w.state_bytes:g} B/param); {efficiency:.2f} of each pool's peak achieved",
        "tokens: LLM tokens (text + merged image tokens) per step; price: the devices a layout "
        "uses x their pool's price per device-hour (ray_dhp/planning/pool_recommend.py)",
    ]
    kinds = Counter(c.reason.split(":", 1)[0] for c in cands if not c.feasible)
    out.append(f"searched {len(cands)} layouts on the pools: {len(ok)} fit"
               + (" (dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ")"
                  if kinds else ""))
    header = ("  #  groups on pools (devices)                schedule   vision      text          "
              "ZeRO step (s)   tokens/s  tokens/price  price/M tok  GiB per rank (headroom)")
    priced = sorted((c for c in ok if c.tokens_per_price is not None),
                    key=lambda c: -c.tokens_per_price)
    for title, ranked in (("best by tokens/s", ok), ("best by tokens per price unit", priced)):
        out += ["", f"{title} (each with its run-file fragment):", header]
        for i, c in enumerate(ranked[:TOP]):
            out += [_row(i + 1, c, pools), *_snippet(c, pools)]
        if not ranked:
            out.append("  (none: " + ("no layout fits the pools)" if not ok else
                                      "no pool has a price_per_device_hour)"))
    if not ok:
        out += ["", "no layout fits: use precision.policy=bf16 (10 B/param), turn on activation "
                    "checkpointing, shorten the samples, or add devices to the pools."]
    return "\n".join(out), bool(ok)
