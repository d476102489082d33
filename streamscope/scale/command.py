"""The ``streamscope harvest`` command: a dataset's values over Ray replicas, into a resumable folder.

    streamscope harvest CHECKPOINT DATASET --values layer_output,mlp_output --layers 8,16 --positions all \\
        --out acts/ --replicas 8 --engine vllm --tensor-parallel-size 1

DATASET is a .jsonl or .parquet file or a datasets folder; ``--column`` names its text or token-id column.
Run the same command again to resume a stopped run. Its arguments are declared in `streamscope.cli_table`
(`harvest_arguments`), which `streamscope --help` reads without importing this module.
"""

from __future__ import annotations

import argparse
import json
import sys

from .ray import HarvestFailed, harvest


def command_harvest(arguments: argparse.Namespace) -> int:
    """Run ``streamscope harvest`` with its parsed `arguments`; return the exit status (1: a replica failed,
    2: refused before any ran)."""
    options = dict(arguments.engine_options)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):  # only where asked: vLLM's settings
        if getattr(arguments, name) != 1:
            options.setdefault(name, getattr(arguments, name))
    harvest_options = {} if arguments.batch_size is None else {"batch_size": arguments.batch_size}
    values = [value.strip() for value in arguments.values.split(",") if value.strip()]
    try:
        folder = harvest(arguments.dataset, arguments.path, values, arguments.layers, arguments.positions,
                         out=arguments.out, replicas=arguments.replicas, engine=arguments.engine,
                         engine_options=options, column=arguments.column, split=arguments.split,
                         shard_size=arguments.shard_size, harvest_options=harvest_options, num_cpus=arguments.num_cpus, num_gpus=arguments.num_gpus,
                         address=arguments.address, format=arguments.format)
    except HarvestFailed as error:
        print(error)
        return 1
    except (ValueError, TypeError, KeyError, IndexError, ImportError, OSError) as error:
        # Refused before any replica ran (a missing column, another run's folder, no cluster...): the reason alone.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"streamscope harvest: {message}", file=sys.stderr)
        return 2
    index = json.loads((folder / "index.json").read_text())
    print(f"wrote {index['prompts']} prompts ({index['tokens']} tokens) in {len(index['shards'])} shards to {folder}")
    for failure in index["failures"]:
        print(f"  replica {failure['replica']} failed on shard {failure['shard']} (rerun by another): "
              f"{failure['error']}")
    return 0
