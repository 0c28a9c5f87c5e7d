"""The machinery: model loading, the rollout engines, distributed bookkeeping, checkpoints, metrics,
sandboxes and checker processes.
Skip on a first read; train.py, gppo.py, reward.py, rollout.py and eval.py show the algorithm."""
