"""`surogate-hf sft [config.yaml]`: Surogate's SFT YAML keys -> SurogateConfig + LoraConfig + TrainingArguments
+ Trainer, and `surogate-hf launch`: accelerate launch with a precision recipe.

schema.py checks the config (before anything loads), data.py builds the datasets, run.py trains and writes the
adapter, metrics.json and loss_curve.png. pyyaml and matplotlib come with the `[cli]` extra and are imported
only when a command needs them.
"""

from __future__ import annotations

import argparse
import sys

from .data import build_data
from .run import run_sft, summary
from .schema import ConfigError, check_config, default_config_text, load_config, require_cli_extra

__all__ = ["ConfigError", "build_data", "check_config", "default_config_text", "load_config", "main", "run_sft"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="surogate-hf", description="Low-precision fine-tuning on the HF stack")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    sft = sub.add_parser("sft", help="supervised fine-tuning (LoRA / QLoRA) from a Surogate-style YAML config")
    sft.add_argument("config", nargs="?", help="YAML config; without it the embedded offline default runs")
    sft.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (value parsed as YAML), e.g. --set max_steps=20")
    sft.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    sub.add_parser(
        "launch", add_help=False,
        help="accelerate launch with a recipe: surogate-hf launch --recipe_config recipe.yaml [accelerate args] train.py",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # everything after `launch` belongs to accelerate launch
        from ..integrations.accelerate import launch_main

        return launch_main(argv[1:])
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__

        print(__version__)
        return 0
    if args.command != "sft":
        parser.print_help()
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"surogate-hf sft: config error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # the [cli] extra is missing: say which, without a traceback
        print(e, file=sys.stderr)
        return 2
    if args.print_config:
        print(require_cli_extra("yaml", "--print-config").safe_dump(cfg, sort_keys=False))
        return 0
    try:
        metrics = run_sft(cfg)
    except ConfigError as e:  # what only the machine can tell (use_cuda_graphs without a GPU), before any work
        print(f"surogate-hf sft: config error: {e}", file=sys.stderr)
        return 2
    print(summary(metrics))
    return 0
