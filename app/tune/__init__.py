"""Hyper-parameter search: ``space`` (tune_spaces/*.yaml -> Optuna distributions), ``objective`` (what a
trial reports to Tune), ``search`` (the Tuner: Optuna TPE + ASHA over lightray runs, resumable)."""
