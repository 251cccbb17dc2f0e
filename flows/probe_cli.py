"""`ballast probe` and `ballast compare`: the artifact probe and the two-sample comparison from the command line.

    ballast probe CHECKPOINT [--spec SPEC] [--base MODEL] [--prompts FILE] [--n 6] [--temperature 0.7]
                             [--max-tokens 512] [--format-tag output] [--json OUT] [--html OUT]
    ballast compare A B [--alpha 0.01] [--json OUT] [--html OUT] [--plots DIR]

CHECKPOINT is a local checkpoint directory or an s3:// URI. Settings come from, in order: the flags,
the spec's `probe:` section (`--spec`), the ProbeConfig defaults; the base model from `--base`, the
spec's `model:`, or the base model the checkpoint's manifest names. `--format-tag none` turns the
format check off. A and B of `compare` are probe reports (.json), checkpoints, trainer run
directories or MLflow run ids (tasks/compare.py, resolve_target).

Exit status: 0 the probe passed / no regression; 1 the probe failed (malformed rate above the
threshold, parity or an identity check failed, or the artifact cannot be loaded) / a regression was
found; 2 bad arguments (a path that does not exist, an invalid setting).
"""
from __future__ import annotations

import json
from pathlib import Path

from flows.cli import UserError, command


def _probe_settings(args):
    """(ProbeConfig, ModelConfig | None, LoraConfig | None, spec | None) from --spec and the flags."""
    from pydantic import ValidationError

    from tasks.spec import ProbeConfig, load_spec
    from trainer.config import ModelConfig
    from trainer.health import tag_pattern

    spec = load_spec(args.spec, args.set) if args.spec else None
    cfg = spec.probe.model_copy() if spec else ProbeConfig()
    flags = {"prompts_file": args.prompts, "n": args.n, "temperature": args.temperature, "max_tokens": args.max_tokens,
             "expected_length": args.expected_length, "max_malformed_rate": args.max_malformed_rate,
             "parity_tolerance": args.parity_tolerance, "seed": args.seed}
    try:
        for name, value in flags.items():
            if value is not None:
                setattr(cfg, name, value)
        if args.format_tag is not None:
            cfg.format_tag = None if args.format_tag.lower() in ("", "none") else args.format_tag
            if cfg.format_tag is not None:
                tag_pattern(cfg.format_tag)
    except ValidationError as e:
        err = e.errors()[0]
        flag = {"prompts_file": "prompts"}.get(str(err["loc"][0]), str(err["loc"][0])).replace("_", "-")
        raise UserError(f"--{flag}: {err['msg']} (got {err.get('input')!r})", 2) from None
    except ValueError as e:
        raise UserError(f"--format-tag: {e}", 2) from None
    if cfg.prompts_file and not Path(cfg.prompts_file).expanduser().is_file():
        raise UserError(f"--prompts {cfg.prompts_file}: no such file; give a .jsonl or .txt of probe prompts", 2)
    model_cfg = spec.model if spec else None
    update = {}
    if args.base:
        update.update(name_or_path=args.base, build_if_missing=None)
    if args.device:
        update["device"] = args.device
    if update and model_cfg is not None:
        model_cfg = model_cfg.model_copy(update=update)
    elif update and args.base:
        model_cfg = ModelConfig(name_or_path=args.base, device=args.device or "auto")
    return cfg, model_cfg, (spec.lora if spec else None), spec


def _check_target(target: str) -> None:
    if not target.startswith("s3://") and not Path(target).expanduser().exists():
        raise UserError(f"{target}: no such checkpoint directory; give a checkpoint path (…/checkpoints/step-NNNNNN) "
                        "or an s3:// URI", 2)


def cmd_probe(args) -> int:
    from tasks.probe import ProbeError, model_config_from_manifest, probe_checkpoint, summary_lines, write_probe_html
    from tasks.store import fetch
    from trainer.checkpoint import CheckpointError, read_manifest

    _check_target(args.checkpoint)
    cfg, model_cfg, lora_cfg, spec = _probe_settings(args)
    cache = Path(args.cache_dir) if args.cache_dir else Path(spec.project_dir if spec else ".ballast") / "cache" / "probe"
    try:
        if model_cfg is None and args.device:  # the manifest's base model, on the device asked for
            try:
                model_cfg = model_config_from_manifest(read_manifest(fetch(args.checkpoint, cache)), device=args.device)
            except CheckpointError as e:
                raise ProbeError(str(e)) from None
        report = probe_checkpoint(args.checkpoint, cfg, model_cfg, cache, lora_cfg=lora_cfg)
    except ProbeError as e:
        print(f"probe FAILED: {e}")
        return 1
    for line in summary_lines(report):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}")
    if args.html:
        write_probe_html(report, args.html)
        print(f"page:   {args.html}")
    return 0 if report["passed"] else 1


@command("probe", "reload a saved checkpoint in a fresh engine and probe it for malformed output (exit 1 on failure)")
def _p_probe(p):
    p.add_argument("checkpoint", help="checkpoint directory (…/checkpoints/step-NNNNNN) or s3:// URI")
    p.add_argument("--spec", help="take model, lora and probe settings from this experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of --spec")
    p.add_argument("--base", help="base model to load the adapter onto (default: the spec's, else the manifest's)")
    p.add_argument("--device", help="'auto', 'cpu', 'cuda', ... (default: the spec's, else auto)")
    p.add_argument("--prompts", help="probe prompts, .jsonl or .txt (default: the spec's, else the shipped set)")
    p.add_argument("--n", type=int, help="samples per prompt (default 6)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0.7)")
    p.add_argument("--max-tokens", type=int, help="max new tokens per sample")
    p.add_argument("--format-tag", help="required tag around the answer, e.g. output; 'none' disables the check")
    p.add_argument("--expected-length", type=int, help="characters a good answer takes (too_long beyond 3x)")
    p.add_argument("--max-malformed-rate", type=float, help="fail above this malformed rate (default 0.25)")
    p.add_argument("--parity-tolerance", type=float, help="max |logprob difference| to the save-time fingerprint")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--html", metavar="OUT", help="write the report as an HTML page")
    p.add_argument("--cache-dir", help="where s3:// checkpoints are downloaded (default <project_dir>/cache/probe)")
    return cmd_probe


# ------------------------------------------------------------------------------------------ compare

def cmd_compare(args) -> int:
    from tasks.compare import compare, plot_comparison, resolve_target, write_comparison_html
    from tasks.probe import ProbeError

    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: give a significance level between 0 and 1, e.g. 0.01", 2)
    probe_cfg = model_cfg = lora_cfg = None
    tracking_uri = args.tracking_uri
    if args.spec:
        from tasks.lineage import tracking_uri as spec_tracking_uri
        from tasks.spec import load_spec
        spec = load_spec(args.spec, args.set)
        probe_cfg, model_cfg, lora_cfg = spec.probe, spec.model, spec.lora
        tracking_uri = tracking_uri or spec_tracking_uri(spec)
    sides = []
    for name, target in (("A", args.a), ("B", args.b)):
        try:
            sides.append(resolve_target(target, probe_cfg=probe_cfg, model_cfg=model_cfg, lora_cfg=lora_cfg,
                                        cache_dir=Path(args.cache_dir) if args.cache_dir else None, tracking_uri=tracking_uri))
        except FileNotFoundError as e:
            raise UserError(f"{name}: {e}", 2) from None
        except ProbeError as e:  # a checkpoint that cannot be probed: a failure, not a bad argument
            raise UserError(f"{name}: {e}", 1) from None
        except ValueError as e:
            raise UserError(f"{name}: {e}", 2) from None
    (report_a, history_a), (report_b, history_b) = sides
    result = compare(report_a, report_b, alpha=args.alpha, labels=(args.label_a or "A", args.label_b or "B"))
    result["a"]["source"], result["b"]["source"] = args.a, args.b
    print(result["summary"])
    plots = []
    if args.plots or args.html:
        plots = plot_comparison(result, Path(args.plots or Path(args.html).with_suffix("")), history_a, history_b)
        if args.plots:
            print(f"plots:  {', '.join(str(p) for p in plots)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"result: {args.json}")
    if args.html:
        write_comparison_html(result, args.html, plots, {"A": args.a, "B": args.b})
        print(f"page:   {args.html}")
    return 1 if result["regression"] else 0


@command("compare", "compare malformed rates of A and B (reports, checkpoints, runs) with Fisher's exact test (exit 1 on a regression)")
def _p_compare(p):
    p.add_argument("a", help="reference: probe report .json, checkpoint, run directory or MLflow run id")
    p.add_argument("b", help="candidate, same kinds as A; the question is whether B is worse than A")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the one-sided test (default 0.01)")
    p.add_argument("--label-a", help="name of A in the verdict (default 'A')")
    p.add_argument("--label-b", help="name of B in the verdict (default 'B')")
    p.add_argument("--spec", help="model, lora and probe settings for probing checkpoints; tracking URI for run ids")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tracking-uri", help="MLflow tracking URI for run ids (default .ballast/mlflow.db)")
    p.add_argument("--cache-dir", help="where s3:// checkpoints are downloaded")
    p.add_argument("--json", metavar="OUT", help="write the comparison as JSON")
    p.add_argument("--html", metavar="OUT", help="write a page with the verdict and plots")
    p.add_argument("--plots", metavar="DIR", help="write rates.png (and curves.png when histories are known)")
    return cmd_compare
