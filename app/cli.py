"""Command line: ``lightray train | tune | prepare | eval | predict | report``, each with its own ``--help``.

``python app/run.py ...`` and ``lightray`` with no subcommand are ``lightray train ...``; the older flags stay as
aliases there: ``--tune`` is ``tune``, ``--report RUN`` is ``report RUN``, ``--prepare-only`` is ``prepare``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from lightray.api import SHORTHANDS
from lightray.config import Config, ConfigError, load_config

COMMANDS = ("train", "tune", "prepare", "eval", "predict", "report")
OVERRIDES = """\
Any config key can be overridden as --SECTION.KEY=VALUE, e.g. --optim.lr_per_256=0.4
--schedule.epochs=4 --comm.mode=topk --comm.ratio=0.01 (sections: data, model, optim, schedule,
scaling, comm, checkpoint, report, cost). Lists and phases take YAML: --data.tiers='[64,128]'.
"""
USAGE = """\
commands (each with its own --help):
  lightray train [--config NAME|PATH] [--data PATH|URI] ...   train a run (the default command)
  lightray tune --space NAME|PATH --trials N ...               search hyper-parameters (Ray Tune + Optuna)
  lightray prepare --data PATH|URI                             build the shard cache and stop
  lightray eval RUN [--data PATH]                              score a run's exported model
  lightray predict RUN IMAGE|DIR... [--top K]                  classify images with it
  lightray report RUN|EXPERIMENT                               plots + report.md (a folder or s3:// URI)

examples:
  lightray train                                     the demo on a local Ray cluster
  lightray train --smoke-test --storage /tmp/runs    a few steps, seconds
  lightray train --config imagenet-rn50-dawnbench --data s3://bucket/imagenet --workers 8:128
  lightray train --resume                            continue the newest run in the storage
  lightray train --model.pretrained=RUN|FILE --config finetune --data DIR   fine-tune from weights
  lightray tune --space demo --trials 8 --concurrent 2
(python app/run.py ... is lightray train ...; --tune, --report RUN and --prepare-only are aliases)
"""


def _run_flags(p: argparse.ArgumentParser) -> None:
    """The flags that make a config: shared by train, tune and prepare."""
    p.add_argument("--config", default=None, metavar="NAME|PATH",
                   help="recipe name from the package's recipes (demo, smoke, cifar10, imagenette, "
                        "imagenet-rn50-dawnbench, imagenet-rn18-16ep, finetune) or a YAML path (default: demo; "
                        "with --data, picked from the data and the GPUs; smoke with --smoke-test)")
    p.add_argument("--data", metavar="PATH|URI", help="ImageFolder tree (train/<class>/*.jpg, val/<class>/*.jpg), "
                   "Parquet files (image + label columns, train-*/validation-*) or WebDataset tars (.jpg + .cls): "
                   "a local path or a pyarrow URI such as s3://bucket/imagenet; default: the embedded demo")
    p.add_argument("--storage", metavar="DIR|URI", help="where runs are written (default ./lightray_runs or "
                   "$LIGHTRAY_STORAGE); shared storage (s3://) on a cluster")
    p.add_argument("--name", help="run name (default: <recipe>-<date>); the run folder is <storage>/<name>")
    p.add_argument("--workers", metavar="N|MIN:MAX", help="number of training workers, or an elastic range")
    p.add_argument("--gpu", choices=["auto", "true", "false"], help="use GPUs (default auto: when the cluster has any)")
    p.add_argument("--smoke-test", action="store_true", help="the same code path on tiny data for a few steps")
    p.add_argument("--mlflow", metavar="URI", help="also log params, metrics and the summary to MLflow at URI")
    p.add_argument("--verbose", action="store_true", help="show Ray's own logs and debug output")


def build_parser(command: str = "train") -> argparse.ArgumentParser:
    """The parser of ``lightray COMMAND`` for train, tune, prepare and report."""
    if command == "report":
        p = argparse.ArgumentParser(prog="lightray report", description="Render plots and report.md for a run "
                                    "folder, or with the search report for a tune experiment (local or s3://).")
        p.add_argument("run", metavar="RUN|EXPERIMENT", help="the run or experiment folder, or its URI")
        return p
    about = {"train": "Train an ImageNet-class classifier on a Ray cluster of (spot) GPU machines.",
             "tune": "Search hyper-parameters with Ray Tune + Optuna + ASHA; each trial is a run.",
             "prepare": "Build the shard cache for the data and stop."}[command]
    p = argparse.ArgumentParser(prog=f"lightray {command}", description=about, epilog=OVERRIDES + "\n" + USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _run_flags(p)
    if command in ("train", "tune"):
        p.add_argument("--resume", action="store_true", help="continue a run (--name, default the newest in the "
                       "storage) from its latest valid checkpoint; with tune, resume the experiment")
    if command == "tune":
        p.add_argument("--space", metavar="NAME|PATH", help="search space: a name from the package's spaces "
                       "(demo, large_batch) or a YAML path (default demo)")
        p.add_argument("--trials", type=int, help="number of trials (default: the space file's)")
        p.add_argument("--concurrent", type=int, help="trials run at once (default: the space file's)")
    return p


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """(command, its arguments): a leading subcommand, else ``train`` with the older flags read as aliases."""
    if argv and argv[0] in COMMANDS:
        return argv[0], argv[1:]
    for i, arg in enumerate(argv):
        if arg == "--tune":
            return "tune", argv[:i] + argv[i + 1:]
        if arg == "--prepare-only":
            return "prepare", argv[:i] + argv[i + 1:]
        if arg == "--report" and i + 1 < len(argv):  # --report.KEY=VALUE is a config override, not this
            return "report", [argv[i + 1]]
        if arg.startswith("--report="):
            return "report", [arg.split("=", 1)[1]]
    return "train", argv


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


def user_overrides(args: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    """Every config key the command line sets: the dotted overrides and the shorthand flags."""
    overrides = parse_overrides(rest)
    for flag, key in {"storage": "storage", "name": "name", **SHORTHANDS}.items():
        if getattr(args, flag, None):
            overrides[key] = getattr(args, flag)
    if args.verbose:
        overrides["report.verbose"] = "true"
    return overrides


def config_from_args(args: argparse.Namespace, rest: list[str]) -> Config:
    recipe = args.config or ("smoke" if args.smoke_test else "demo")
    return load_config(recipe, user_overrides(args, rest))


def picks_recipe(args: argparse.Namespace, cfg: Config) -> bool:
    """No recipe named and a source of the user's own: the recipe is picked from it (lightray/recipe_pick.py)."""
    return not args.config and not getattr(args, "smoke_test", False) and cfg.data.source != "demo"


def picked_config(args: argparse.Namespace, rest: list[str], cfg: Config) -> Config:
    """``cfg`` (the default recipe) rebuilt on the recipe picked for its source; prints the one line that says
    which and why."""
    from lightray.recipe_pick import pick_recipe

    pick = pick_recipe(cfg)
    print(pick.line(), flush=True)
    return load_config(pick.recipe, {**pick.overrides, **user_overrides(args, rest)})  # the user's keys win


def write_reports(path: str) -> list[str]:
    """``lightray report PATH``: the report of a run or Tune experiment folder (local or on object storage), with
    the search report for an experiment; returns the paths written."""
    from lightray.report.markdown import make_report, render_anywhere
    from lightray.tune.report import is_experiment, write_search_report

    def render(folder: str) -> list[str]:
        out = [str(make_report(folder))]
        if is_experiment(folder):  # a tune experiment: importances, parallel coordinates, stop rungs
            out += [str(p) for p in write_search_report(folder).values()]
        return out

    return render_anywhere(path, render)


def main(argv: list[str] | None = None, *, guard: bool = False) -> int:
    """Run one command. ``guard`` (the program's entry points only, never a caller in the same process): the
    driver of a run or a search runs in a child that a guardian process speaks for if Ray ends it
    (lightray/driver/guard.py)."""
    command, argv = split_command(sys.argv[1:] if argv is None else argv)
    if command in ("eval", "predict"):  # on an exported model (no Ray)
        from lightray.model_cli import COMMANDS as MODEL_COMMANDS

        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        return MODEL_COMMANDS[command](argv)
    if command == "report":
        from lightray.report.plots import ReportError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            print("\n".join(write_reports(build_parser("report").parse_args(argv).run)))
        except ReportError as exc:  # a folder it cannot report on: one line that names it, not a traceback
            print(f"lightray: error: {exc}", file=sys.stderr)
            return 2
        return 0
    args, rest = build_parser(command).parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:  # what the units decided is in metrics.jsonl; the console keeps the driver's phases
        for name in ("lightray.unit", "lightray.data.ingest"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        cfg = config_from_args(args, rest)
    except ConfigError as exc:
        print(f"lightray: error: {exc}", file=sys.stderr)
        return 2
    from lightray.driver import guard as driver_guard

    if guard and command != "prepare":
        # Before Ray or torch is imported: the fork must not copy their threads.
        status = driver_guard.guard()
        if status is not None:  # the guardian, after the driver ended
            return status
    try:
        if picks_recipe(args, cfg):  # after the guard's fork: the pick reads the source with pyarrow's threads
            cfg = picked_config(args, rest, cfg)
        return run_command(command, cfg, args)
    except Exception as exc:
        from lightray.data.source import DataError

        if not isinstance(exc, (ConfigError, DataError, FileNotFoundError, FileExistsError)):
            raise
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


def run_command(command: str, cfg: Config, args: argparse.Namespace) -> int:
    """train, tune or prepare on a checked config; usage errors propagate to ``main``."""
    if command == "tune":
        from lightray.tune.search import run_search

        run_search(cfg, space=args.space, trials=args.trials, concurrent=args.concurrent, resume=args.resume)
        return 0
    if command == "prepare":
        from lightray.data.prepare import prepare_main
        from lightray.driver.runner import connect_ray, resolve_run

        resolve_run(cfg)
        connect_ray(cfg, args.verbose)
        print(prepare_main(cfg))  # the manifest folder: a local path or the cache URI
        return 0
    from lightray.api import resolve
    from lightray.driver.runner import run_training
    from lightray.report.progress import print_summary_table

    resolve(cfg, args.resume)
    if args.verbose:
        import yaml

        print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False), flush=True)
    else:  # about 150 lines a person does not read before the first step: the run's folder keeps them
        print(f"lightray: run {cfg.name}; its resolved config is saved as config.yaml in the run's folder "
              "(--verbose prints it here)", flush=True)
    summary = run_training(cfg, resume=args.resume, verbose=args.verbose)
    if cfg.report.mlflow:
        from lightray.report.mlflow_log import log_run

        log_run(cfg.report.mlflow, summary["run_dir"])
    print_summary_table(summary, verbose=args.verbose)
    return 0


def console() -> int:
    """The ``lightray`` command."""
    return main(guard=True)
