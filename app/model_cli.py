"""``lightray eval RUN`` and ``lightray predict RUN IMAGE|DIR...``: use a trained run's exported model."""

from __future__ import annotations

import argparse
import json
import sys


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightray eval", description="Score a run's exported model on labelled "
                                "images: top-1, top-5 and per-class accuracy; writes eval.json.")
    p.add_argument("run", metavar="RUN", help="a run folder (or its model/ folder), local or s3://")
    p.add_argument("--data", metavar="PATH", help="labelled images, local or s3://: PATH/val/<class>/* or "
                   "PATH/<class>/*, or Parquet files / WebDataset tars (their validation files, else every file "
                   "under PATH) (default: the run's own val split, from its shard cache)")
    p.add_argument("--weights", choices=["best", "final"], default="best", help="which export (default best)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    p.add_argument("--out", metavar="PATH", help="where to write eval.json (default <run>/eval.json)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return p


def predict_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightray predict", description="Classify images with a run's exported "
                                "model: the top labels with their probabilities.")
    p.add_argument("run", metavar="RUN", help="a run folder (or its model/ folder), local or s3://")
    p.add_argument("inputs", nargs="+", metavar="IMAGE|DIR", help="image files and/or folders (searched recursively)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="labels shown per image (default 5)")
    p.add_argument("--weights", choices=["best", "final"], default="best", help="which export (default best)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, ...")
    p.add_argument("--json", action="store_true", help="one JSON document: a list of {path, top} / {path, error}")
    return p


def run_eval(argv: list[str]) -> int:
    args = eval_parser().parse_args(argv)
    from lightray.inference import evaluate_folder

    try:
        res = evaluate_folder(args.run, args.data, args.weights, args.device, args.batch_size, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"lightray: error: {exc}", file=sys.stderr)
        return 2
    for s in res["unreadable"]:
        print(f"lightray: skipped {s['path']}: {s['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "predictions"}, indent=1))
        return 0
    pre = res["preprocess"]
    how = (f"{pre['size']}px centre crop (ratio {pre['crop_ratio']:g})" if pre["mode"] == "center"
           else f"rectangular, short side {pre['size']}px")
    print(f"{res['run']} ({res['weights']} weights) on {res['data']}: {res['images']} images, {how}, "
          f"{res['device']} {res['precision']}")
    print(f"top-1 {res['top1']:.4f}   top-5 {res['top5']:.4f}")
    width = max(len(c) for c in res["per_class"])
    print(f"{'class':<{width}}  images  top-1")
    for c, v in res["per_class"].items():
        print(f"{c:<{width}}  {v['images']:>6}  " + (f"{v['top1']:.4f}" if v["top1"] is not None else "-"))
    if res.get("written"):
        print(f"wrote {res['written']}")
    return 0


def run_predict(argv: list[str]) -> int:
    args = predict_parser().parse_args(argv)
    from lightray.inference import predict

    try:
        results = predict(args.run, args.inputs, args.top, args.weights, args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"lightray: error: {exc}", file=sys.stderr)
        return 2
    scored = 0
    for r in results:
        if "error" in r:
            print(f"lightray: skipped {r['path']}: {r['error']}", file=sys.stderr)
            continue
        scored += 1
        if not args.json:
            print(f"{r['path']}: " + ", ".join(f"{t['label']} {t['prob']:.3f}" for t in r["top"]))
    if args.json:
        print(json.dumps(results, indent=1))
    if scored == 0:
        print(f"lightray: error: none of the {len(results)} inputs could be scored", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"eval": run_eval, "predict": run_predict}
