"""The control plane: a typed protocol, a pure membership policy, the coordinator that
serves it, and the worker's membership client.

``protocol`` owns the wire format; ``policy`` owns every decision (who is a member, when an
epoch starts, which plan); ``coordinator`` owns the sockets, the TCPStore and the clock and
feeds the policy typed events; ``client`` is the worker's side of the channel.
"""
