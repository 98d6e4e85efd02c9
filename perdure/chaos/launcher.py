"""The local launcher with the fault schedule applied (and, later, the live view)."""

from __future__ import annotations

from perdure.launch.local import LocalLauncher


class ChaosLauncher(LocalLauncher):
    """Injects each fault of ``config.chaos`` when its trigger is reached."""
