"""The ``perdure`` command. Each subcommand lives in its own module; heavy imports (torch)
happen inside the commands, so ``perdure --help`` stays fast."""

from __future__ import annotations

import importlib
import warnings

import click

from perdure import __version__
from perdure.config import RenamedWarning

warnings.simplefilter("default", RenamedWarning)  # an old name is the user's to fix: say so

# name -> module:attribute of a click command or group; missing modules are skipped, so a
# subcommand appears exactly when the code that backs it exists.
_COMMANDS = {
    "config": "perdure.cli.config:config",
    "ckpt": "perdure.cli.ckpt:ckpt",
    "data": "perdure.cli.data:data",
    "run": "perdure.cli.run:run",
    "worker": "perdure.cli.worker:worker",
    "coordinator": "perdure.cli.worker:coordinator",
    "demo": "perdure.cli.demo:demo",
    "report": "perdure.cli.report:report",
    "sim": "perdure.cli.sim:sim",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="perdure")
def main() -> None:
    """perdure: resilient, reproducible data-parallel training for PyTorch."""


def _register() -> None:
    for name, target in _COMMANDS.items():
        module, _, attr = target.partition(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        main.add_command(getattr(mod, attr), name=name)


_register()
