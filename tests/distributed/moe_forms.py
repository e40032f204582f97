"""The three forms of a sharded MoE checkpoint directory transformers' conversion mapping reads
(`ray_dhp.models.hf_convert`), made from a ``save_pretrained`` directory (fused experts
``[E, 2I, H]`` / ``[E, H, I]``) by rewriting each tensor: the Hub's transposed fused experts
(``hub_fused``) and per-expert tensors (``per_expert``). Shared by `test_moe_loading.py` and
`tests/unit/test_hf_convert.py`; ``INTER`` is the tiny model's ``moe_intermediate_size``
(``2I = 32 != H = 64``, so a missed transpose changes shapes)."""

import json
import os
import shutil

INTER = 16


def _rewrite(src: str, dst: str, convert) -> str:
    """A copy of the sharded directory ``src`` with every tensor ``(k, v)`` replaced by
    ``convert(k, v)`` (a list of ``(key, tensor)``), in the same shard file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = os.path.join(dst, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    weight_map = {}
    for name in sorted(set(idx["weight_map"].values())):
        out = {}
        for k, v in load_file(os.path.join(dst, name)).items():
            for k2, v2 in convert(k, v):
                out[k2] = v2.contiguous()
                weight_map[k2] = name
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    idx["weight_map"] = weight_map
    with open(index, "w") as f:
        json.dump(idx, f)
    return dst


def hub_fused(k, v):
    """The Hub's Qwen3-VL-MoE layout: the fused experts' last two dims swapped."""
    return [(k, v.transpose(1, 2) if ".mlp.experts." in k else v)]


def per_expert(k, v):
    """One tensor per expert and projection (``mlp.experts.{i}.gate_proj.weight`` ...)."""
    base = k.rsplit(".", 1)[0] + "."
    if k.endswith("mlp.experts.gate_up_proj"):
        return [(f"{base}{e}.{p}.weight", v[e, s]) for p, s in
                (("gate_proj", slice(0, INTER)), ("up_proj", slice(INTER, None))) for e in range(len(v))]
    if k.endswith("mlp.experts.down_proj"):
        return [(f"{base}{e}.down_proj.weight", v[e]) for e in range(len(v))]
    return [(k, v)]
