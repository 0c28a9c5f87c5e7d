"""The machinery: distributed bookkeeping, checkpoints, metrics, sandboxes and worker pools.
Skip on a first read; train.py, gppo.py, reward.py, rollout.py and eval.py show the algorithm."""
