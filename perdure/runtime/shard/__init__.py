"""Replica groups of k ranks that share one copy of the optimizer state (``train.shard_degree``).

``owners`` decides who owns which parameter and who sends which shard at an epoch's start
(pure functions); ``state`` cuts and merges optimizer state dicts by shard; ``group`` runs
them on an epoch's process groups.
"""
