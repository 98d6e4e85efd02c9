"""One replica's math, minus the network: the user's task, a slot's gradient, the slot
buffer's layout and the trainer (model, optimizer, data, decision log, the update).

Everything here is a pure function of (config, dataset version, decision log, step).
"""
