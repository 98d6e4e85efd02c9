"""Launchers: the local one (coordinator and workers as processes on this machine)."""
