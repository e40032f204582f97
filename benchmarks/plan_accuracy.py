"""Measured vs planned per-rank memory (issue #42): for each row of a family x feature matrix, the
engine runs on spawned gloo ranks (CPU, tiny models, fp32 unless the row says otherwise) and
each rank's three points are measured (`benchmarks.measure.measure_engine_step`: model state,
bytes saved for backward by one micro-batch's forward, the optimizer step's peak; at ZeRO stage
3 a fourth, what FSDP2 holds unsharded during the forward and backward) and compared
with what `ray-dhp plan` computes for the same shapes and layout, from the same functions
(`ray_dhp.planning.memory_audio.module_rank_state`, `estimate_module_ranks`,
`ray_dhp.planning.step_peak.rank_step_peak` with CPU's AdamW: the single-tensor loop).

The planned activations compared are the *saved* part (`text_activation_parts`): the logits'
gradient and CP's all-to-all buffers are transient working set, counted by the plan on top.
``python -m benchmarks.plan_accuracy [--slow] [--write] [ROW ...]`` runs the rows (default:
the default suite's; ``ROW``: a row's name; the rows measured replace theirs in the newest
results, the other rows kept), writes ``benchmarks/results/plan-accuracy-cpu2-<date>.json`` and, with
``--write``, the table into docs/plan_accuracy.md between its markers (``--from-results``: the
table of the newest JSON, nothing run; ``tests/unit/test_plan_accuracy_doc.py`` checks that the
doc shows it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plan_accuracy.md"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- accuracy table: begin -->", "<!-- accuracy table: end -->"
TOLERANCE = 0.05  # issue #42: every planned figure within 5% of the measured one
POINTS = ("state", "activations", "step_peak")
FSDP_POINT = "fsdp_work"  # rows with a module at ZeRO stage 3: what FSDP2 holds unsharded


@dataclass(frozen=True)
class Case:
    """One row: a family's tiny model under a layout (`Topology.build` keywords) and features."""

    name: str
    family: str = "qwen2_5_vl"
    layout: dict = field(default_factory=lambda: dict(
        placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2))
    precision: str = "fp32"
    checkpointing: bool = False
    packing: bool = False
    video: bool = False       # each sample one clip (8 frames at 4 fps: 2 temporal patches)
    audio: float = 0.0        # seconds of one audio clip per sample (besides its image; 0: none)
    samples: int = 2          # the step's samples
    micro_batches: int = 1    # the step's micro-batches (the rows: one, the micro-batch is the step)
    slow: bool = True
    tolerance: dict = field(default_factory=dict)  # point -> (tolerance, reason) where not 5%

    def tol(self, point: str) -> float:
        return self.tolerance.get(point, (TOLERANCE, ""))[0]


def _lay(placement="collocated", vision=(2, 1), text=(2, 1), audio=None, **kw) -> dict:
    """`Topology.build` keywords: ``vision`` (sp, dp), ``text`` (tp, dp), ``audio`` (dp) or None."""
    (sp, vdp), (tp, tdp) = vision, text
    if audio is not None:
        from ray_dhp.parallel.topology import EncoderDegrees

        kw["encoders"] = {"audio": EncoderDegrees(dp=audio)}
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp, **kw)


def _generic_rows() -> tuple:
    """The verified generic families (the fp64 matrix's list) less the two rows above."""
    try:
        from tests.distributed.parity import GENERIC_FAMILIES
    except ImportError:  # outside a checkout: the benchmark's own rows only
        return ()
    return tuple(f for f in GENERIC_FAMILIES if f not in ("llava", "gemma3"))


GENERIC_ROWS = _generic_rows()

# Generic families whose activations (or step peak) the planner misses by more than 5%, with the
# reason (none since 2026-12-04: the last three, step peaks, were ZeRO-1's freed gradients and the
# frozen parameters' buckets, now modelled; Qwen4-Exp's activations, below); the state is exact for
# every one.
# Both sides' activations are measured from the model's own code on the meta device where that
# runs (the tower: `ray_dhp.models.vision_saved`; the decoder layers: `ray_dhp.models.text_saved`);
# the others keep the block formulas.
GENERIC_GAPS: dict = {}
# (Qwen4-Exp's activations read 0.565 until the decoder probe split a ``rowwise_split_input``
# module's input as DTensor does, a slice of its own: the probe had marked the hyper-connections'
# normed input sharded, and with it the whole Gated DeltaNet mixer computed from it.)

CASES = (
    Case("demo SP2 / TP2", slow=False),
    Case("demo SP2xDP2 / TP2xDP2 ZeRO-1", layout=_lay(vision=(2, 2), text=(2, 2), vision_zero=1,
                                                      text_zero=1),
         samples=4),  # 2 images per vision replica: one per SP rank (window-aligned)
    Case("demo disjoint SP2 / TP2", layout=_lay("disjoint")),
    Case("demo text SP (TP2)", layout=_lay(text_sequence_parallel=True)),
    Case("demo ZeRO-0 DP2", layout=_lay(vision=(1, 2), text=(1, 2), vision_zero=0, text_zero=0)),
    Case("demo ZeRO-2 DP2", layout=_lay(vision=(1, 2), text=(1, 2), vision_zero=2, text_zero=2)),
    Case("demo ZeRO-3 DP2", layout=_lay(vision=(1, 2), text=(1, 2), vision_zero=3, text_zero=3)),
    Case("demo offload DP2", layout=_lay(vision=(1, 2), text=(1, 2), vision_offload=True,
                                          text_offload=True)),
    Case("demo checkpointing", checkpointing=True,
         tolerance={"activations": (TOLERANCE, "the plan counts the rotary cos / sin of the LM "
                                    "and the ViT, which the recompute closures hold: no saved-"
                                    "tensor hook sees them (9,984 B; the row is 9,910 B over)")}),
    Case("demo bf16_mixed", precision="bf16_mixed"),
    Case("demo packing", packing=True),
    Case("demo CP2", layout=_lay(vision=(2, 1), text=(1, 1), text_cp=2)),
    Case("qwen3_vl (deepstack) SP2 / TP2", family="qwen3_vl"),
    # the experts' rows per rank depend on the routing: the plan assumes them balanced
    Case("qwen3_vl_moe EP2 (DP2)", family="qwen3_vl_moe",
         layout=_lay(vision=(1, 2), text=(1, 2), text_ep=2)),
    Case("qwen3_vl_moe DP2 (stock experts)", family="qwen3_vl_moe",
         layout=_lay(vision=(1, 2), text=(1, 2))),
    Case("qwen3_5 (DeltaNet) SP2 / TP2", family="qwen3_5"),
    Case("internvl DP2 / TP2", family="internvl", layout=_lay(vision=(1, 2), text=(2, 1))),
    Case("demo video SP1 (DP2) / TP2", video=True, layout=_lay(vision=(1, 2), text=(2, 1))),
    Case("demo video SP2 / TP2", video=True),
    Case("llava (generic) DP2 / TP2", family="llava", layout=_lay(vision=(1, 2), text=(2, 1))),
    Case("gemma3 (generic) DP2 / TP2", family="gemma3", layout=_lay(vision=(1, 2), text=(2, 1))),
    Case("gemma3 (generic) DP2 / TP2 text SP", family="gemma3",
         layout=_lay(vision=(1, 2), text=(2, 1), text_sequence_parallel=True)),
    # the thinker's three modules collocated on 2 ranks; each sample an image and a 1 s clip
    Case("omni audio DP2 / vision SP2 / TP2", family="qwen2_5_omni", audio=1.0,
         layout=_lay(audio=2)),
    Case("omni audio DP2 bf16_autocast", family="qwen2_5_omni", audio=1.0,
         precision="bf16_autocast", layout=_lay(audio=2)),
    Case("qwen2_vl SP2 / TP2", family="qwen2_vl"),
    Case("qwen3_5_moe SP2 / TP2", family="qwen3_5_moe"),
    # text SP: the sparse block runs on the gathered sequence (`ray_dhp/models/qwen3_5_moe.py`)
    Case("qwen3_5_moe text SP (TP2)", family="qwen3_5_moe",
         layout=_lay(text_sequence_parallel=True)),
    Case("qwen3_5_moe EP2 (DP2)", family="qwen3_5_moe",
         layout=_lay(vision=(1, 2), text=(1, 2), text_ep=2)),
    # InternViT rotates nothing: the Ulysses count of a tower without rotary q / k, measured
    Case("internvl SP2 / TP2", family="internvl"),
    Case("demo bf16", precision="bf16"),
    Case("demo bf16_autocast", precision="bf16_autocast"),
    Case("demo checkpointing bf16_autocast", precision="bf16_autocast", checkpointing=True),
    # text ZeRO-3 over DP2 with TP2 inside each replica: the whole embedding gradient at the step
    Case("demo ZeRO-3 TP2xDP2", layout=_lay(vision=(1, 4), text=(2, 2), vision_zero=3,
                                             text_zero=3), samples=4),
    # FSDP2 gathers bf16 weights, makes bf16 gradients and reduce-scatters them in fp32
    Case("demo ZeRO-3 DP2 bf16_mixed", precision="bf16_mixed",
         layout=_lay(vision=(1, 2), text=(1, 2), vision_zero=3, text_zero=3)),
    Case("qwen3_5_moe ZeRO-3 DP2 (text)", family="qwen3_5_moe",
         layout=_lay(vision=(1, 2), text=(1, 2), text_zero=3)),
    # offloaded bf16 gradients pass through a fp32 staging buffer on their way to the host
    Case("demo offload DP2 bf16_mixed", precision="bf16_mixed",
         layout=_lay(vision=(1, 2), text=(1, 2), vision_offload=True, text_offload=True)),
) + tuple(Case(f"{f} (generic) DP2 / TP2", family=f, layout=_lay(vision=(1, 2), text=(2, 1)),
                tolerance=GENERIC_GAPS.get(f, {})) for f in GENERIC_ROWS)


def case_named(name: str) -> Case:
    (c,) = [c for c in CASES if c.name == name]
    return c


# -- the run ------------------------------------------------------------------------------------

def train_config(case: Case):
    from ray_dhp.config.train_loop import TrainLoopConfig

    return TrainLoopConfig(lr=1e-3, global_batch_size=case.samples, micro_batches=case.micro_batches,
                           num_steps=2,
                           seed=0, weight_decay=0.1, max_grad_norm=1.0, precision=case.precision,
                           activation_checkpointing=case.checkpointing, packing=case.packing)


def make_steps(tmp, case: Case) -> list:
    """Two steps of ``case.samples`` same-shaped samples (one 56x56 image or one 8-frame 56x56
    clip each): every sample has the plan's shape (its vision tokens; the text rows padded to
    the longest)."""
    from ray_dhp import demo
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler

    cfg = train_config(case)
    proc = demo.tiny_processor(case.family)
    if case.video:
        path = _video_set(Path(tmp) / f"video_{case.family}")
        from ray_dhp.data.video import VideoSettings

        side = 56 * 56  # 4x4 patches per frame
        proc = proc.configured(video=VideoSettings(min_pixels=side, max_pixels=side))
    elif case.audio:
        path = _audio_set(Path(tmp) / f"audio_{case.family}", case.audio)
    else:
        path = demo.make_dataset(Path(tmp) / f"data_{case.family}", num_samples=8, seed=0,
                                 image_sizes=((56, 56),))
    sampler = StepSampler(read_annotations(path), proc, resolve_data_root(path), cfg.sampler_config())
    sampler.allow_audio = bool(case.audio)
    return [sampler.next_step() for _ in range(2)]


def _video_set(root: Path) -> Path:
    """Eight records of the same 8-frame clip (a moving square, 56x56, 4 fps)."""
    from ray_dhp.demo.video import moving_square, write_mp4

    root.mkdir(parents=True, exist_ok=True)
    write_mp4(root / "clip.mp4", moving_square("right", 8, (56, 56), side=16), fps=4)
    record = {"video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhich way does the square move?"},
        {"from": "gpt", "value": "right"}]}
    (root / "train.jsonl").write_text((json.dumps(record) + "\n") * 8)
    return root / "train.jsonl"


def _audio_set(root: Path, seconds: float) -> Path:
    """Eight records, each one 56x56 image and one clip of ``seconds`` at 16 kHz (the feature
    extractor's rate: no resampling)."""
    from ray_dhp import demo
    from ray_dhp.demo.audio import make_audio_dataset

    images = demo.make_dataset(root / "img", num_samples=8, seed=0, image_sizes=((56, 56),))
    clips = make_audio_dataset(root / "aud", num_samples=8, seed=0, seconds=(seconds,),
                               rates=(16000,))
    out = []
    for im, au in zip(images.read_text().splitlines(), clips.read_text().splitlines()):
        r, a = json.loads(im), json.loads(au)
        r["image"], r["audio"] = f"img/{r['image']}", f"aud/{a['audio']}"
        r["conversations"][0]["value"] = "<image>\n<audio>\nDescribe the image and the sound."
        out.append(json.dumps(r) + "\n")
    (root / "train.jsonl").write_text("".join(out))
    return root / "train.jsonl"


def rank_body(rank, world, case: Case, steps):
    """On each spawned rank: build the engine and measure its second step."""
    import torch

    from benchmarks.measure import measure_engine_step
    from ray_dhp import demo
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.step.engine import DHPEngine

    groups = build_groups(Topology.build(**case.layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(case.family), groups, train_config(case).step_config())
    return measure_engine_step(engine, steps[0], steps[1])


def measure(case: Case, tmp, run=None) -> list:
    """Per rank: the measured points (``run``: a spawn helper ``(fn, world, args)``, default
    `ray_dhp.train.launch.spawn`; the tests pass `tests.spawn.run_on_ranks`)."""
    from ray_dhp.parallel.topology import Topology

    if run is None:
        from ray_dhp.train.launch import spawn as run
    steps = make_steps(tmp, case)
    world = Topology.build(**case.layout).world_size
    outs = run(rank_body, world, (case, steps))
    shape = _sample_shape(steps[1][0])
    return [dict(o, **shape) for o in outs]


def _sample_shape(micro_batch: list) -> dict:
    """Vision tokens per sample (all samples alike) and the samples of the micro-batch."""
    grids = [s.image_grid_thw for s in micro_batch]
    vt = {int(g.prod(-1).sum()) if g is not None else 0 for g in grids}
    assert len(vt) == 1, f"samples of different vision shapes: {vt}"
    g = grids[0]  # attention segment: a frame of a clip (one temporal patch), else the image
    frame = int(g[0, 1] * g[0, 2]) if g is not None and int(g[0, 0]) > 1 else None
    return {"vision_tokens": vt.pop(), "samples": len(micro_batch), "segment": frame}


# -- the plan -----------------------------------------------------------------------------------

def planned(case: Case, got: list) -> list:
    """Per rank, what the planner gives for the shapes ``got`` (`measure`) ran: state (on the
    device), saved activations, the CPU step peak."""
    from ray_dhp import demo
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.planning.memory import (ActivationSettings, merged, text_activation_parts,
                                         text_layers, text_probe, weight_cast_bytes)
    from ray_dhp.planning.memory_vision import vision_activation_parts
    from ray_dhp.planning.memory_audio import (count_audio, estimate_module_ranks,
                                               module_rank_state, without_audio)
    from ray_dhp.planning.fsdp_working import fsdp_working_bytes
    from ray_dhp.planning.step_peak import audio_updated, rank_step_peak
    from ray_dhp.step.precision import POLICIES

    config = demo.tiny_model_config(case.family)
    topo = Topology.build(**case.layout)
    counts, policy = count_params(config), POLICIES[case.precision]
    settings = ActivationSettings.of(policy, "flash", case.checkpointing)  # CPU SDPA
    vt, n = got[0]["vision_tokens"], got[0]["samples"]
    rows, seq = next(g["lm_rows"] for g in got if g["lm_rows"] is not None)
    seq *= topo.text.cp  # the LM sees its CP slice of each row
    merge = merged(config)
    text_tokens = seq - vt // merge  # per LM row: the padded (packed) row less its features
    v_samples = -(-n // topo.vision.dp)
    ag = topo.encoder("audio")
    audio = count_audio(config) if ag is not None else None
    est = estimate_module_ranks(config, topo, counts, audio, audio_seconds=case.audio,
                                vision_tokens=vt, text_tokens=text_tokens, samples=v_samples,
                                text_samples=rows, settings=settings, policy=policy,
                                segment_tokens=got[0]["segment"], lm_tokens_included=True,
                                audio_samples=-(-n // ag.dp) if ag is not None else None)
    base = without_audio(counts) if audio is not None else counts
    probed = text_probe(config, settings, seq)  # a generic family's measured layers (or None)
    _, transient = text_activation_parts(
        config.text_config, rows * seq, topo.text.inner, settings, seq,
        seq_parallel=topo.text_sequence_parallel, cp=topo.text.cp, head_norms=counts.text_head_norms,
        layers=text_layers(config, topo, counts) if probed is not None else None, probed=probed)
    _, v_transient = vision_activation_parts(config.vision_config, v_samples * vt,
                                             topo.vision.inner, settings, got[0]["segment"] or vt,
                                             config)
    casts = weight_cast_bytes(config, counts, topo.text.inner, settings)  # recomputed: transient
    transient += casts.text_recomputed
    v_transient += casts.vision_recomputed
    out = []
    for r, m in enumerate(est):
        st = module_rank_state(counts, audio, topo, r, policy)
        a = audio.params if audio is not None and ag.hosts(r) else 0
        a_up = audio_updated(audio, topo, r, policy) if a else 0
        act = ((m.vision_act - v_transient if m.vision_act else 0.0) + m.audio_act
               + (m.text_act - transient if m.text_act else 0.0))
        out.append({"state": st.device_total, "activations": act,
                    "by_module": {"vision": m.vision_act - v_transient if m.vision_act else 0.0,
                                  "text": m.text_act - transient if m.text_act else 0.0,
                                  "audio": m.audio_act},
                    "step_peak": rank_step_peak(st, policy, base, topo, r, config.text_config,
                                                a if ag is not None and ag.size > 1 else 0,
                                                a_up, cpu=True),
                    FSDP_POINT: fsdp_working_bytes(base, topo, r, policy)})
    return out


def compare(case: Case, got: list) -> dict:
    """The row: per rank and point, planned, measured and their ratio; ``worst`` the largest
    deviation per point over the ranks."""
    plan = planned(case, got)
    ranks = []
    points = _points(got)
    for r, (g, p) in enumerate(zip(got, plan)):
        meas = {"state": g["state"], "activations": g["saved"]["total"], "step_peak": g["step_peak"],
                FSDP_POINT: g.get(FSDP_POINT)}
        ranks.append({pt: {"planned": float(p[pt]), "measured": float(meas[pt] or 0),
                           "ratio": p[pt] / meas[pt] if meas[pt] else None} for pt in points})
        ranks[-1]["activations"]["by_module"] = {  # planned, measured per module
            k: [float(v), float(g["saved"].get(k, 0))] for k, v in p["by_module"].items()
            if v or g["saved"].get(k)}
    worst = {pt: max((rk[pt] for rk in ranks if rk[pt]["ratio"] is not None),
                     key=lambda x: abs(x["ratio"] - 1)) for pt in points}
    layout = {k: ({e: dataclasses.asdict(d) for e, d in v.items()} if k == "encoders" else v)
              for k, v in case.layout.items()}  # JSON
    return {"name": case.name, "family": case.family, "layout": layout,
            "precision": case.precision, "ranks": ranks, "worst": worst,
            "tolerance": {pt: list(case.tolerance.get(pt, (TOLERANCE, ""))) for pt in points}}


def _points(got: list) -> tuple:
    """The points measured: the three, and ``fsdp_work`` where a rank runs FSDP2."""
    return POINTS + ((FSDP_POINT,) if any(g.get(FSDP_POINT) for g in got) else ())


def off_points(row: dict, case: Case) -> list:
    """Points of ``row`` outside the case's tolerance."""
    return [(pt, w["ratio"]) for pt, w in row["worst"].items() if abs(w["ratio"] - 1) > case.tol(pt)]


# -- the table ----------------------------------------------------------------------------------

def _kib(b: float) -> str:
    return f"{b / 1024:,.0f}"


def table(rows: list) -> str:
    """The markdown table: per row and point the rank whose ratio is the furthest from 1."""
    head = ("| row | family | precision | " + " | ".join(
        f"{p} planned / measured (KiB), ratio" for p in ("state", "activations (saved)", "step peak",
                                                          "ZeRO-3 working set"))
        + " | note |")
    out = [head, "|---|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        cells = []
        for pt in POINTS + (FSDP_POINT,):
            w = row["worst"].get(pt)
            cells.append("–" if w is None else
                         f"{_kib(w['planned'])} / {_kib(w['measured'])}, {w['ratio']:.3f}")
        note = "; ".join(f"{pt}: ±{t:.0%} ({why})" for pt, (t, why) in row["tolerance"].items() if why)
        out.append(f"| {row['name']} | {row['family']} | {row['precision']} | "
                   + " | ".join(cells) + f" | {note} |")
    return "\n".join(out)


def newest_results() -> Optional[Path]:
    found = sorted(RESULTS.glob("plan-accuracy-cpu2-*.json"))
    return found[-1] if found else None


def committed_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def main(argv=None) -> int:
    import datetime
    import tempfile

    argv = sys.argv[1:] if argv is None else argv
    flags = {a for a in argv if a.startswith("-")}
    if flags - {"--slow", "--write", "--from-results"}:
        print(__doc__.split("\n\n")[-1].strip(), file=sys.stderr)
        return 0 if flags & {"-h", "--help"} else 2
    if "--from-results" in argv:
        _write(json.loads(newest_results().read_text())["rows"])
        return 0
    names = [a for a in argv if not a.startswith("-")]
    cases = ([case_named(n) for n in names] if names
             else [c for c in CASES if "--slow" in argv or not c.slow])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            row = compare(case, measure(case, tmp))
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    if newest_results() is not None:  # re-measured rows replace theirs, the rest stay
        rows = _merged(json.loads(newest_results().read_text())["rows"], rows)
    out = RESULTS / f"plan-accuracy-cpu2-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    if "--write" in argv:
        _write(rows)
    return 0


def _merged(old: list, new: list) -> list:
    """``old`` rows with ``new`` ones in place of those of the same name, in `CASES`' order."""
    by_name = {r["name"]: r for r in old} | {r["name"]: r for r in new}
    order = [c.name for c in CASES]
    return sorted(by_name.values(), key=lambda r: order.index(r["name"]) if r["name"] in order
                  else len(order))


def _write(rows: list) -> None:
    text = DOC.read_text()
    DOC.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + table(rows) + "\n"
                   + text[text.index(END):])


if __name__ == "__main__":
    sys.exit(main())

