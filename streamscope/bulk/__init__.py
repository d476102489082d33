"""Bulk requests at engine speed: harvest values from many prompts, steer many sampled completions.

Both engines serve the same two calls under the names of a trace::

    harvest = model.harvest(prompts, ["layer_output", "mlp.mlp_output"], layers=[4, 8], positions="last")
    harvest["layer_output"][i]          # prompt i: [len(layers), positions, hidden_size]

    steer = streamscope.Steer("layer_output", layer=16, vector=v, scale=4.0)
    result = model.generate(prompts, max_tokens=128, steer=[steer],
                            harvest={"values": "layer_output", "layers": [16]})
    result.texts, result.tokens, result.harvest

Nothing is traced: the run's values are resolved once on the model's envoy
tree (the same descriptors a trace reads, so a harvest equals a trace's
reads bit for bit on the same batch), then one hook per module call reads and
edits every request of a step at its rows (`streamscope.bulk.apply`). On vLLM
the hooks run in the engine's worker, by each request's token span; on
transformers, on padded batches (`batch_size`).

``model.harvest(prompts, values, steer=[...])`` reads the values under steers
(a prompt-only run). A `Steer` adds, sets, ablates or clamps a direction,
optionally norm-matched (`streamscope.bulk.operations`); `apply_steers` does
the same inside a trace.

Positions are those of each prompt: ``"last"``, ``"all"``, a slice, indices
(negative from the prompt's end), or one list per prompt. A harvest reads the
prompt; a steer edits its prompt positions (by default every one but the
first token, an attention sink in trained models: ``positions="all"`` edits it
too) and, unless ``generated=False``, every generated token. Where a steer and a harvest meet at one value, the
harvest reads the steered value. ``out=folder`` writes safetensors shards as
the prompts finish (`load_harvest`, `iter_harvest` read them back), each of
``shard_size`` prompts, by default as many as hold 1 GiB of rows (at most
1,024), so a harvest's host memory stays bounded whatever its shape.
Everything is checked before the engine runs: an unknown value, a block out
of range, a vector of the wrong width or positions past a prompt's end raise
at once; every bad steer (an argument its mode does not use, an edit too
large for the stream's measured norm) as a `SteerError`, a ValueError.
"""

from .results import Generation, Harvest, iter_harvest, load_harvest
from .conditions import Condition
from .dose import DoseWarning, SteerError
from .sites import value_names
from .steer import Steer, apply_steers

__all__ = ["Steer", "SteerError", "Condition", "DoseWarning", "apply_steers", "Harvest", "Generation", "load_harvest", "iter_harvest", "value_names"]
