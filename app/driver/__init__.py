"""The driver: it connects to Ray, starts the worker group and keeps a run going through faults. ``runner`` (a
run from start to summary.json), ``run_lock`` and ``lock_store`` (one driver per run), ``guard`` (speaks for a
driver Ray ended), ``cluster_loss`` (the cluster going away), ``stale_runs`` (what a dead driver still books),
``spot_watcher`` (the cloud's notice -> a node drain), ``placement`` (why a worker group waits), ``billing``."""
