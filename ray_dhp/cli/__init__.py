"""The ``ray-dhp`` command line (also ``python -m ray_dhp``).

Subcommands:
    train CONFIG.yaml [k=v ...]    build the trainer from the run file and fit it
    plan CONFIG.yaml [k=v ...]     layout, meshes and per-rank memory (no Ray, no weights);
                                   --recommend: the placement the cost model prefers
    config --print-defaults        a complete run file with every key, commented
    export CHECKPOINT OUT_DIR      a Hugging Face model directory from a checkpoint
                                   (--dtype bfloat16: the weights' dtype; --source DIR)
    docs                           the Markdown configuration reference (docs/configuration.md)

Configuration mistakes (unknown keys, degrees that do not fit the model, worker counts) are
reported before Ray starts, with exit status 2.
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
    pl.add_argument("--vision-tokens", default="4096", help="patch tokens per sample; a comma "
                    "list prints one estimate each (default 4096)")
    pl.add_argument("--text-tokens", type=int, default=512, help="text tokens per sample")
    pl.add_argument("--attention", choices=["flash", "eager"], default="flash")
    pl.add_argument("--device-gib", type=float, default=80.0, help="accelerator memory")
    r = pl.add_argument_group("recommendation (ray_dhp/recommend.py)")
    r.add_argument("--recommend", action="store_true", help="rank collocated and disjoint "
                   "layouts by predicted step time and print the best as a run-file fragment")
    r.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the run "
                   "file's worker count)")
    r.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step "
                   "(default: optim.micro_batches)")
    r.add_argument("--top", type=int, default=8, help="layouts to list")
    r.add_argument("--peak-tflops", type=float, default=None, help="dense peak per GPU (default: "
                   "989 for bf16 autocast, 67 for fp32: H100/H200 SXM)")
    r.add_argument("--efficiency", type=float, default=0.4, help="achieved fraction of the peak")
    r.add_argument("--link-gbs", type=float, default=360.0, help="intra-node link GB/s per GPU")
    c = sub.add_parser("config", help="print a complete run file")
    c.add_argument("--print-defaults", action="store_true", required=True)
    e = sub.add_parser("export", help="export a checkpoint as a Hugging Face model directory")
    e.add_argument("checkpoint")
    e.add_argument("out_dir")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the written weights (default: the checkpoint's, fp32)")
    e.add_argument("--source", default=None, help="model directory to copy "
                   "generation_config.json and the chat template from (default: the one the "
                   "run started from, recorded in the checkpoint)")
    sub.add_parser("docs", help="print docs/configuration.md")
    return p


def _load(args):
    from ray_dhp.run_config import load_run_file

    return load_run_file(args.config, args.overrides)


def _cmd_train(args) -> int:
    from ray_dhp.cli.train import train

    train(_load(args))
    return 0


def _cmd_plan(args) -> int:
    from ray_dhp.cli.plan import plan_text

    rf = _load(args)
    tokens = [int(x) for x in str(args.vision_tokens).split(",") if x.strip()]
    if args.recommend:
        return _recommend(args, rf, tokens)
    if args.gpus is not None or args.micro_batches is not None:
        from ray_dhp.cli.schema import ConfigError

        raise ConfigError("--gpus and --micro-batches are options of --recommend; add --recommend.")
    print(plan_text(rf, vision_tokens=tokens, text_tokens=args.text_tokens,
                    attention=args.attention, device_gib=args.device_gib))
    return 0


def _recommend(args, rf, tokens) -> int:
    from ray_dhp.cli.recommend import recommend_text
    from ray_dhp.recommend import Hardware

    hw = Hardware(peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                  efficiency=args.efficiency, link_bw=args.link_gbs * 1e9)
    text, ok = recommend_text(rf, gpus=args.gpus, micro_batches=args.micro_batches,
                              vision_tokens=tokens, text_tokens=args.text_tokens,
                              attention=args.attention, device_gib=args.device_gib,
                              hardware=hw, top=args.top)
    print(text)
    return 0 if ok else 1


def _cmd_config(args) -> int:
    from ray_dhp.cli.render import defaults_yaml

    print(defaults_yaml(), end="")
    return 0


def _cmd_docs(args) -> int:
    from ray_dhp.cli.render import markdown_reference

    print(markdown_reference(), end="")
    return 0


def _export_fn():
    """``ray_dhp.export_hf`` (written separately; imported lazily so the CLI works without it)."""
    import importlib

    try:
        return importlib.import_module("ray_dhp.export").export_hf
    except (ImportError, AttributeError):
        import ray_dhp

        try:
            return getattr(ray_dhp, "export_hf")
        except AttributeError:
            return None


def _cmd_export(args) -> int:
    export_hf = _export_fn()
    if export_hf is None:
        print("ray-dhp export: this install has no ray_dhp.export_hf (ray_dhp/export.py); "
              "update ray_dhp to a version with checkpoint export.", file=sys.stderr)
        return 1
    out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, source=args.source)
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
