"""Command line: flags -> config -> the one command to run."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from app.config import Config, ConfigError, load_config

EPILOG = """\
Any config key can be overridden as --SECTION.KEY=VALUE, e.g. --optim.lr_per_256=0.4
--schedule.epochs=4 --comm.mode=topk --comm.ratio=0.01 (sections: data, model, optim, schedule,
scaling, comm, checkpoint, report, cost). Lists and phases take YAML: --data.tiers='[64,128]'.

examples:
  python app/run.py                                  train the demo on a local Ray cluster
  python app/run.py --smoke-test --storage /tmp/runs a few steps, seconds
  python app/run.py --config imagenet-rn50-dawnbench --data s3://bucket/imagenet --workers 8:128
  python app/run.py --resume                         continue the newest run in the storage
  python app/run.py --tune --space tune_spaces/demo.yaml --trials 8 --concurrent 2
  python app/run.py --report lightray_runs/demo-...  plots + report.md for a run or a tune experiment
  python app/run.py eval RUN [--data PATH]           score the run's exported model (see eval --help)
  python app/run.py predict RUN IMAGE|DIR... --top 3 classify images with it (see predict --help)
  python app/run.py --model.pretrained=RUN|FILE --config finetune --data DIR   fine-tune from weights
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightray", description="Train ImageNet-class classifiers fast on a Ray "
                                "cluster of (spot) GPU machines.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="NAME|PATH",
                   help="recipe name from app/recipes (demo, smoke, imagenet-rn50-dawnbench, imagenet-rn18-16ep) "
                        "or a YAML path (default: demo; smoke with --smoke-test)")
    p.add_argument("--data", metavar="PATH|URI", help="ImageFolder tree (train/<class>/*.jpg, val/<class>/*.jpg), "
                   "Parquet files (image + label columns, train-*/validation-*) or WebDataset tars (.jpg + .cls): "
                   "a local path or a pyarrow URI such as s3://bucket/imagenet; default: the embedded demo")
    p.add_argument("--storage", metavar="DIR|URI", help="where runs are written (default ./lightray_runs or "
                   "$LIGHTRAY_STORAGE); shared storage (s3://) on a cluster")
    p.add_argument("--name", help="run name (default: <recipe>-<date>); the run folder is <storage>/<name>")
    p.add_argument("--workers", metavar="N|MIN:MAX", help="number of training workers, or an elastic range")
    p.add_argument("--gpu", choices=["auto", "true", "false"], help="use GPUs (default auto: when the cluster has any)")
    p.add_argument("--smoke-test", action="store_true", help="the same code path on tiny data for a few steps")
    p.add_argument("--resume", action="store_true", help="continue a run (--name, default the newest in the "
                   "storage) from its latest valid checkpoint; with --tune, resume the experiment")
    p.add_argument("--prepare-only", action="store_true", help="build the shard cache for the data and stop")
    p.add_argument("--tune", action="store_true", help="search hyper-parameters with Ray Tune + Optuna + ASHA")
    p.add_argument("--space", metavar="PATH", help="search space YAML for --tune (default tune_spaces/demo.yaml)")
    p.add_argument("--trials", type=int, help="number of --tune trials (default: the space file's)")
    p.add_argument("--concurrent", type=int, help="trials run at once for --tune (default: the space file's)")
    p.add_argument("--report", metavar="RUN", help="render plots and report.md for a run or tune experiment folder (a "
                   "folder or an s3:// URI)")
    p.add_argument("--mlflow", metavar="URI", help="also log params, metrics and the summary to MLflow at URI")
    p.add_argument("--verbose", action="store_true", help="show Ray's own logs and debug output")
    return p


def parse_overrides(rest: list[str]) -> dict[str, Any]:
    """``--a.b=v`` / ``--a.b v`` pairs -> {"a.b": "v"}; anything else is a usage error."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"{arg}: unknown argument; expected a flag from --help or --SECTION.KEY=VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                raise ConfigError(f"{key}: missing value; expected --{key}=VALUE")
            value = rest[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out


def config_from_args(args: argparse.Namespace, rest: list[str]) -> Config:
    overrides = parse_overrides(rest)
    if args.data:
        overrides["data.source"] = args.data
    if args.storage:
        overrides["storage"] = args.storage
    if args.name:
        overrides["name"] = args.name
    if args.workers:
        overrides["scaling.workers"] = args.workers
    if args.gpu:
        overrides["scaling.use_gpu"] = args.gpu
    if args.mlflow:
        overrides["report.mlflow"] = args.mlflow
    if args.verbose:
        overrides["report.verbose"] = "true"
    recipe = args.config or ("smoke" if args.smoke_test else "demo")
    return load_config(recipe, overrides)


def write_reports(path: str) -> list[str]:
    """``--report PATH``: the report of a run or Tune experiment folder (local or on object storage), with the
    search report for an experiment; returns the paths written."""
    from app.report.markdown import make_report, render_anywhere
    from app.tune.report import is_experiment, write_search_report

    def render(folder: str) -> list[str]:
        out = [str(make_report(folder))]
        if is_experiment(folder):  # a tune experiment: importances, parallel coordinates, stop rungs
            out += [str(p) for p in write_search_report(folder).values()]
        return out

    return render_anywhere(path, render)


def main(argv: list[str] | None = None, *, guard: bool = False) -> int:
    """Run one command. ``guard`` (the program's entry points only, never a caller in the same process): the
    driver of a run or a search runs in a child that a guardian process speaks for if Ray ends it
    (app/train/driver_guard.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("eval", "predict"):  # subcommands on an exported model (no Ray)
        from app.model_cli import COMMANDS

        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        return COMMANDS[argv[0]](argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.report:
        print("\n".join(write_reports(args.report)))
        return 0
    try:
        cfg = config_from_args(args, rest)
    except ConfigError as exc:
        print(f"lightray: error: {exc}", file=sys.stderr)
        return 2
    from app.train import driver_guard

    if guard and not args.prepare_only:
        # Before Ray or torch is imported: the fork must not copy their threads.
        status = driver_guard.guard()
        if status is not None:  # the guardian, after the driver ended
            return status
    from app.data.source import DataError

    try:
        if args.tune:
            from app.tune.search import run_search

            run_search(cfg, space=args.space, trials=args.trials, concurrent=args.concurrent, resume=args.resume)
            return 0
        if args.prepare_only:
            from app.data.prepare import prepare_main
            from app.train.runner import connect_ray, resolve_run

            resolve_run(cfg)
            connect_ray(cfg, args.verbose)
            print(prepare_main(cfg))  # the manifest folder: a local path or the cache URI
            return 0
        from app.report.progress import print_summary_table
        from app.train.runner import resolve_run, run_training

        resolve_run(cfg, args.resume)
        if cfg.model.pretrained:  # a missing weights file is a usage error here, not a crash in every worker
            from app.train.finetune import resolve_pretrained

            resolve_pretrained(cfg.model.pretrained)
        import yaml

        print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False), flush=True)
        summary = run_training(cfg, resume=args.resume, verbose=args.verbose)
        if cfg.report.mlflow:
            from app.report.mlflow_log import log_run

            log_run(cfg.report.mlflow, summary["run_dir"])
        print_summary_table(summary)
        return 0
    except (ConfigError, DataError, FileNotFoundError, FileExistsError) as exc:
        if isinstance(exc, OSError) and exc.filename is None:
            # An OS error that names no file is not a usable one-line message: show where it came from.
            import traceback

            traceback.print_exc()
        print(f"lightray: error: {exc}", file=sys.stderr)
        return 2
    finally:
        # Python has had its say (a return, a handled error, an exception on its way to the traceback), and
        # Ray's exit hooks, which can block on a cluster that is gone, have not run yet.
        driver_guard.tell(python_exit=True)


def console() -> int:
    """The ``lightray`` command."""
    return main(guard=True)
