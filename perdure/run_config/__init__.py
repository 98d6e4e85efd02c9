"""The run config: the components' config dataclasses composed into one ``RunConfig``.

It sits above every component (it imports their configs) and below everything that runs
(runtime, launch, cli), so the bottom-layer ``perdure.config`` package (problems,
building, diffs) imports no component and no component imports this package's parents.
"""

from perdure.run_config.compose import (
    RunConfig,
    RunOptions,
    anchored,
    canonical,
    config_from_dict,
    config_hash,
    dataset_path,
    load_config,
    resolve_path,
    to_dict,
    with_overrides,
)

__all__ = [
    "RunConfig",
    "RunOptions",
    "anchored",
    "canonical",
    "config_from_dict",
    "config_hash",
    "dataset_path",
    "load_config",
    "resolve_path",
    "to_dict",
    "with_overrides",
]
