"""The ``ray-dhp`` command line (also ``python -m ray_dhp``).

Subcommands:
    train CONFIG.yaml [k=v ...]    build the trainer from the run file and fit it
    plan CONFIG.yaml [k=v ...]     layout, meshes and per-rank memory (no Ray, no weights);
                                   --recommend: the placement the cost model prefers
    config --print-defaults        a complete run file with every key, commented
    config CONFIG.yaml [k=v ...]   the run file resolved (overrides applied) and checked
    export CHECKPOINT OUT_DIR      a Hugging Face model directory from a checkpoint
                                   (--dtype bfloat16: the weights' dtype; --source DIR)
    docs                           the Markdown configuration reference (docs/configuration.md)

``plan``, ``config`` and ``train`` check a run file the same way (`RunFile.validate`): unknown
keys, values out of range, degrees that do not fit the model, worker counts, loop settings that
contradict each other. Mistakes are reported before Ray starts, naming the run-file key, with
exit status 2. ``train`` also refuses a run name whose run already finished (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["main"]

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray-dhp", description="Disaggregated hybrid parallelism "
                                "(Ulysses SP for the ViT, TP for the LLM) on Ray Train.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a run file")
    t.add_argument("config", help="YAML run file")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl = sub.add_parser("plan", help="print the layout and a memory estimate (no Ray)")
    pl.add_argument("config", help="YAML run file")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl.add_argument("--vision-tokens", default=None, help="patch tokens per sample; a comma "
                    "list prints one estimate each (default 4096, or one image of a tower "
                    "that takes a fixed image size); a resolution mix "
                    "size:weight,... (e.g. 256:0.7,4096:0.25,16384:0.05) makes --recommend cost "
                    "the mix, balanced by cost")
    pl.add_argument("--video", default=None, metavar="FRAMESxHxW", help="plan for one video per "
                    "sample instead of --vision-tokens: FRAMES sampled frames (data.video.fps, "
                    "2 per second by default: 240 = two minutes) of HxW pixels (multiples of "
                    "patch x merge, 28 for Qwen2/2.5-VL), e.g. 240x448x448; its patch tokens = "
                    "ceil(FRAMES / 2) x H/14 x W/14, attention per frame; a comma list prints one "
                    "estimate each (--recommend plans for the longest)")
    pl.add_argument("--text-tokens", type=int, default=512, help="text tokens per sample")
    pl.add_argument("--audio-seconds", type=float, default=30.0, help="with an audio group "
                    "(audio: section): seconds of audio per sample, one clip (Whisper features: "
                    "100 frames/s, 50 encoder tokens/s, 25 LLM tokens/s)")
    pl.add_argument("--attention", choices=["flash", "eager"], default=None, help="attention "
                    "kernel of the activation estimate (default: flash with scaling.use_gpu, "
                    "else eager)")
    pl.add_argument("--device", default=None, help="the accelerator to plan for (h100, h200, "
                    "a100-80gb, ...: ray_dhp/planning/devices.py; default: scaling.accelerator, "
                    "else h100 with scaling.use_gpu; on CPU no limit is checked)")
    pl.add_argument("--device-gib", type=float, default=None, help="accelerator memory in GiB "
                    "(default: the accelerator's)")
    pl.add_argument("--device-margin-gib", type=float, default=None, help="GiB per device kept "
                    "free for the CUDA context, communicator buffers and allocator "
                    "fragmentation (default: scaling.device_margin_gib, else the accelerator's)")
    pl.add_argument("--nodes", type=int, default=None, help="nodes of the cluster: show which "
                    "ranks share a node and which collectives cross the node boundary (bytes "
                    "per step); with --recommend, GPUs = nodes x --gpus-per-node")
    pl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (workers) per node")
    pl.add_argument("--internode-gbs", type=float, default=45.0, help="GB/s per GPU between "
                    "nodes (one 400 Gb/s NIC per GPU: ~45)")
    r = pl.add_argument_group("recommendation (ray_dhp/planning/recommend.py)")
    r.add_argument("--recommend", action="store_true", help="rank collocated and disjoint "
                   "layouts by predicted step time and print the best as a run-file fragment")
    r.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the run "
                   "file's worker count)")
    r.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step "
                   "(default: optim.micro_batches)")
    r.add_argument("--top", type=int, default=8, help="layouts to list")
    r.add_argument("--context-parallel", action="store_true", help="with --recommend: also rank "
                   "every text.context_parallel degree (long sequences)")
    r.add_argument("--peak-tflops", type=float, default=None, help="dense peak per GPU (default: "
                   "989 for bf16 autocast, 67 for fp32: H100/H200 SXM)")
    r.add_argument("--efficiency", type=float, default=0.4, help="achieved fraction of the peak")
    r.add_argument("--link-gbs", type=float, default=360.0, help="intra-node link GB/s per GPU")
    r.add_argument("--pool", default=None, metavar="POOL.yaml", help="pools of accelerators "
                   "(ray_dhp/planning/pools.py; default: the run file's hardware: section): "
                   "--recommend places each module group on a pool, ranked by tokens/s and by "
                   "tokens per price unit")
    c = sub.add_parser("config", help="print a complete run file: the defaults, or CONFIG.yaml "
                       "resolved and checked")
    c.add_argument("config", nargs="?", help="YAML run file (omit with --print-defaults)")
    c.add_argument("overrides", nargs="*", help="section.key=value overrides")
    c.add_argument("--print-defaults", action="store_true", help="every key at its default, "
                   "commented")
    e = sub.add_parser("export", help="export a checkpoint as a Hugging Face model directory")
    e.add_argument("checkpoint")
    e.add_argument("out_dir")
    e.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the written weights (default: the checkpoint's, fp32)")
    e.add_argument("--source", default=None, help="model directory to copy "
                   "generation_config.json and the chat template from (default: the one the "
                   "run started from, recorded in the checkpoint)")
    e.add_argument("--lora", choices=["merge", "adapter"], default="merge",
                   help="a LoRA run (optim.modules.llm.lora): merge the adapters into the "
                   "weights (a full model, default) or write a PEFT adapter directory")
    sub.add_parser("docs", help="print docs/configuration.md")
    return p


def _load(args):
    from ray_dhp.run_file import load_run_file

    return load_run_file(args.config, args.overrides)


def _cmd_train(args) -> int:
    from ray_dhp.cli.train import train

    train(_load(args))
    return 0


def _default_vision_tokens(rf) -> str:
    """One image of the tower's fixed size (its patches) where the family takes images of one
    size (`FamilySpec.image_patches`); else 4096 patches."""
    from ray_dhp.models import family_of, load_model_config

    config = load_model_config(rf.model_spec())
    return str(family_of(config).image_patches(config) or 4096)


def _cmd_plan(args) -> int:
    from ray_dhp.cli.plan import plan_text

    rf = _load(args)
    from ray_dhp.cli.recommend import parse_vision_tokens

    if args.video is not None and args.vision_tokens is not None:
        from ray_dhp.cli.schema import ConfigError

        raise ConfigError("--video and --vision-tokens both size the vision input; give one.")
    tokens, args.vision_mix = parse_vision_tokens(args.vision_tokens or _default_vision_tokens(rf))
    args.videos = _videos(args.video)
    if args.videos:
        from ray_dhp.cli.plan import vision_cases
        from ray_dhp.models import load_model_config

        tokens = [vt for _, vt, _ in vision_cases(load_model_config(rf.model_spec()), [],
                                                   args.videos)]
    from ray_dhp.cli.pool_report import pools_of

    pools, where = pools_of(rf, args.pool)
    if args.recommend:
        return _recommend_pools(args, rf, tokens, pools, where) if pools else \
            _recommend(args, rf, tokens)
    if args.gpus is not None or args.micro_batches is not None:
        from ray_dhp.cli.schema import ConfigError

        raise ConfigError("--gpus and --micro-batches are options of --recommend; add --recommend.")
    print(plan_text(rf, vision_tokens=tokens, text_tokens=args.text_tokens,
                    attention=args.attention, device_gib=args.device_gib, videos=args.videos,
                    audio_seconds=_audio_seconds(args.audio_seconds), device=args.device,
                    margin_gib=args.device_margin_gib))
    if pools:
        from ray_dhp.cli.pool_report import pools_lines

        print("\n".join(["", *pools_lines(pools, where)]))
    if args.nodes is not None:
        from ray_dhp.cli.plan import nodes_text

        print(nodes_text(rf, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         vision_tokens=max(tokens), text_tokens=args.text_tokens,
                         attention=args.attention, internode_bw=args.internode_gbs * 1e9,
                         audio_seconds=args.audio_seconds))
    return 0


def _audio_seconds(seconds: float) -> float:
    if not seconds > 0 or seconds == float("inf"):
        from ray_dhp.cli.schema import ConfigError

        raise ConfigError(f"--audio-seconds {seconds:g}: give a positive, finite clip length.")
    return seconds


def _videos(text):
    """``--video``: the `ray_dhp.planning.video.VideoShape` list (None without the flag)."""
    if text is None:
        return None
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.planning.video import parse_videos

    try:
        return parse_videos(text)
    except ValueError as e:
        raise ConfigError(f"--video {e}") from None


def _recommend(args, rf, tokens) -> int:
    from ray_dhp.cli.recommend import recommend_text
    from ray_dhp.planning.recommend import Hardware

    from ray_dhp.cli.plan import budget_of_run

    args.attention = args.attention or "flash"
    budget = budget_of_run(rf, args.device, args.device_gib, args.device_margin_gib, gpu=True)
    hw = Hardware(peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                  efficiency=args.efficiency, link_bw=args.link_gbs * 1e9,
                  internode_bw=args.internode_gbs * 1e9, gpus_per_node=args.gpus_per_node)
    gpus = args.gpus
    if gpus is None and args.nodes is not None:
        gpus = args.nodes * args.gpus_per_node
    text, ok = recommend_text(rf, gpus=gpus, micro_batches=args.micro_batches,
                              vision_tokens=tokens, text_tokens=args.text_tokens,
                              attention=args.attention, budget=budget,
                              hardware=hw, top=args.top,
                              vision_mix=getattr(args, "vision_mix", None),
                              videos=getattr(args, "videos", None),
                              audio_seconds=_audio_seconds(args.audio_seconds),
                              context_parallel=args.context_parallel)
    print(text)
    return 0 if ok else 1


def _recommend_pools(args, rf, tokens, pools, where) -> int:
    from ray_dhp.cli.pool_report import pool_recommend_text
    from ray_dhp.cli.schema import ConfigError

    given = [f for f, v in (("--gpus", args.gpus), ("--nodes", args.nodes), ("--device", args.device),
                            ("--device-gib", args.device_gib),
                            ("--device-margin-gib", args.device_margin_gib), ("--video", args.video),
                            ("--peak-tflops", args.peak_tflops)) if v is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: the pools ({where}) say which devices there are "
                          "and what they do; drop the flag or plan without pools.")
    text, ok = pool_recommend_text(rf, pools, where, micro_batches=args.micro_batches,
                                   vision_tokens=tokens, text_tokens=args.text_tokens,
                                   attention=args.attention or "flash",
                                   efficiency=args.efficiency,
                                   vision_mix=getattr(args, "vision_mix", None))
    print(text)
    return 0 if ok else 1


def _cmd_config(args) -> int:
    from ray_dhp.cli.render import defaults_yaml, yaml_of
    from ray_dhp.cli.schema import ConfigError

    if args.print_defaults == bool(args.config):
        raise ConfigError("give either --print-defaults or a run file (ray-dhp config RUN.yaml "
                          "[section.key=value ...]).")
    print(defaults_yaml() if args.print_defaults else yaml_of(_load(args)), end="")
    return 0


def _cmd_docs(args) -> int:
    from ray_dhp.cli.render import markdown_reference

    print(markdown_reference(), end="")
    return 0


def _export_fn():
    """``ray_dhp.export_hf`` (written separately; imported lazily so the CLI works without it)."""
    import importlib

    try:
        return importlib.import_module("ray_dhp.checkpointing.export").export_hf
    except (ImportError, AttributeError):
        import ray_dhp

        try:
            return getattr(ray_dhp, "export_hf")
        except AttributeError:
            return None


def _cmd_export(args) -> int:
    export_hf = _export_fn()
    if export_hf is None:
        print("ray-dhp export: this install has no ray_dhp.export_hf (ray_dhp/checkpointing/export.py); "
              "update ray_dhp to a version with checkpoint export.", file=sys.stderr)
        return 1
    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, source=args.source,
                        overwrite=args.overwrite, lora=args.lora)
    except (FileExistsError, FileNotFoundError, ValueError) as e:  # said plainly, no traceback
        print(f"ray-dhp export: {e}", file=sys.stderr)
        return 1
    print(f"[ray_dhp] exported {args.checkpoint} -> {out or args.out_dir}")
    return 0


_COMMANDS = {"train": _cmd_train, "plan": _cmd_plan, "config": _cmd_config,
             "export": _cmd_export, "docs": _cmd_docs}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ray-dhp``; returns the exit status (0 ok, 2 configuration error)."""
    from ray_dhp.cli.schema import ConfigError

    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"ray-dhp {args.command}: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
