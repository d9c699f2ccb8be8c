"""Synthetic recall tasks (MQAR in two layouts, copy): numpy generators, a small in-memory trainer, sweeps.

generators.py  seeded numpy samplers returning {"inputs": int32 [N,T], "labels": int32 [N,T]} (-100 = no loss)
task.py        the ``task:`` section of an eval config (TaskConfig) and the loader that splits it off
metrics.py     per-query-token accuracy, exact match, recall lag of every query
train.py       train one model on one task setting and evaluate it on held-out batches
sweep.py       mixer x setting x seed sweeps: one trained model and one record per run
report.py      the accuracy table, the JSON record and the PNG plots of a sweep
"""
