"""The data plane of a membership epoch: its process group, the reduction, state copies.

``group`` builds an epoch's gloo (or NCCL) group with abandonable operations and maps the
backend's failures to :class:`~group.CommFailed`; ``reducer`` is the seam every reduction
plugs into (``chain`` is the first); ``transfer`` copies a live replica's state to joiners;
``exchange`` is a small all-gather over the store for the checkpoint commit.
"""
