"""Text sequence parallelism, measured (issue #13): saved-activation bytes of the language model
per rank with Megatron sequence parallelism on/off, against tensor_parallel = 1.

One image of ``--length`` patches (the other samples of the batch are text-only, so one text
replica holds the long sequence), the DHP engine collocated on ``--ranks`` ranks (vision SP =
ranks throughout), exact counts from `measure.ActivationCounter` ("text" = everything saved
outside the vision tower), for TP = 1, 2, 4, ... with and without sequence parallelism, with and
without activation checkpointing. The memory model's text term (`memory_model.text_act_elems`)
is evaluated on the same shapes and reported next to the counts.

Run: ``python -m benchmarks.text_sp [--ranks 4] [--length 2048] [--shape vitheavy]``; writes
``benchmarks/results/text-sp-<shape>-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cases(world: int) -> list:
    out, tp = [(1, False)], 2
    while tp <= world:
        out += [(tp, False), (tp, True)]
        tp *= 2
    return out


def _count_layer_inputs(engine, acts) -> list:
    """Count the decoder-layer inputs into ``acts`` as "text", each storage once together with
    what ``acts`` saw: non-reentrant activation checkpointing keeps exactly these per block —
    the positional input and every tensor among the keyword arguments (the M-RoPE cos/sin and
    the attention mask, held by the checkpointed call until its backward). transformers
    checkpoints a layer's ``forward``, inside its module hooks, so the input kept is the one
    after the TP plan's pre-hooks (layer 0: the sequence slice): the hook is registered after
    them. Returns the hook handles."""
    import torch

    from benchmarks.measure import _is_param, _local

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (tuple, list)):
            for y in x:
                yield from tensors(y)

    def hook(_mod, args, kwargs):
        for t in tensors((args, list(kwargs.values()))):
            if _is_param(t):
                continue
            try:
                st = _local(t).untyped_storage()
                key = (st.data_ptr(), st.nbytes())
            except RuntimeError:
                continue
            if key not in acts._seen:
                acts._seen.add(key)
                acts.bytes["text"] += key[1]

    return [layer.register_forward_pre_hook(hook, with_kwargs=True)
            for layer in engine.family.language_model(engine.text_model).layers]


def text_sp_body(rank, world, opts: dict):
    """Text activation bytes on this rank for every (ac, tp, sequence_parallel) case; each text
    replica gets exactly one sample (the image sample, or a short text-only one)."""
    import torch

    from benchmarks import contenders as C
    from benchmarks import measure, shapes
    from benchmarks.sweep import text_only_sample

    device = torch.device("cpu")
    config = shapes.model_config(opts["shape"])
    image = shapes.make_sample(0, opts["length"], config)
    out = {}
    for ac in (False, True):
        for tp, sp in _cases(world):
            batch = [image] + [text_only_sample(i, config) for i in range(1, world // tp)]
            cfg = dataclasses.replace(C.train_config(len(batch)), activation_checkpointing=ac)
            c = C.DHP(config, cfg, device, sp=world, tp=tp, text_sp=sp)
            acts = measure.ActivationCounter()
            acts.watch_vision(c.vision)
            with acts.count():
                handles = _count_layer_inputs(c.engine, acts) if ac else []
                c.step(batch)
            for h in handles:
                h.remove()
            out[f"ac={int(ac)} tp={tp} sp={int(sp)}"] = acts.as_dict()["text"]
            del c
    return {"per_case": out, "text_tokens": int(image.num_tokens)}


def model_text_bytes(config, tokens: int, tp: int, sp: bool, ac: bool) -> float:
    """The memory model's text activations (fp32) of the rank holding ``tokens`` tokens; with
    checkpointing without the one block being recomputed (alive only during its own backward:
    not part of what is counted here)."""
    from benchmarks import memory_model as mm

    d = mm.Dims.from_config(config)
    elems = mm.text_act_elems(d, tp, ac, sp) - (mm.text_layer_elems(d, tp, sp) if ac else 0)
    return tokens * (elems * 4 + mm.loss_bytes_per_token(d, tp))


def summarise(per_rank: list, config, world: int) -> list:
    tokens = per_rank[0]["text_tokens"]
    rows = []
    for ac in (False, True):
        base = max(r["per_case"][f"ac={int(ac)} tp=1 sp=0"] for r in per_rank)
        for tp, sp in _cases(world):
            got = max(r["per_case"][f"ac={int(ac)} tp={tp} sp={int(sp)}"] for r in per_rank)
            model = model_text_bytes(config, tokens, tp, sp, ac)
            rows.append({"activation_checkpointing": ac, "tp": tp, "sequence_parallel": sp,
                         "text_bytes": got, "fraction_of_tp1": got / base, "ideal": 1 / tp,
                         "within_10pct_of_1_over_tp": abs(got / base * tp - 1) <= 0.10,
                         "model_bytes": model, "model_error": model / got - 1})
    return rows


def _plot(rows: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, ac in zip(axes, (False, True)):
        sel = [r for r in rows if r["activation_checkpointing"] == ac]
        names = [f"TP{r['tp']}" + (" +SP" if r["sequence_parallel"] else "") for r in sel]
        ax.bar(names, [r["fraction_of_tp1"] for r in sel],
               color=["#37a" if r["sequence_parallel"] else "#999" for r in sel])
        ax.plot(names, [r["ideal"] for r in sel], "k_", markersize=20, label="1/TP")
        ax.set_title(("with" if ac else "without") + " activation checkpointing")
        ax.set_ylabel("text activations / rank (x TP=1)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    from benchmarks import shapes
    from benchmarks.launcher import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--shape", default="vitheavy")
    a = p.parse_args(argv)
    per_rank = spawn(text_sp_body, a.ranks, (dict(shape=a.shape, length=a.length),), backend="gloo", threads=1)
    config = shapes.model_config(a.shape)
    rows = summarise(per_rank, config, a.ranks)
    date = datetime.date.today().isoformat()
    hw = f"cpu{os.cpu_count()}"
    result = {"shape": a.shape, "hardware": hw, "date": date, "ranks": a.ranks, "length": a.length,
              "text_tokens": per_rank[0]["text_tokens"], "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"text-sp-{a.shape}-{hw}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    _plot(rows, stem + ".png", f"{a.shape}: one image of {a.length} patches, {a.ranks} ranks, exact counts")
    for r in rows:
        print(json.dumps(r))
    return result


if __name__ == "__main__":
    main()
