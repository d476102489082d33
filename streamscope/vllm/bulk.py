"""The bulk path on vLLM: the worker applies a run's requests with one hook per module per step, by token span.

The client checks the run against its own envoy tree, then, per chunk of
prompts: sends the plan to the worker (``collective_rpc``), runs the prompts
through bare ``llm.generate`` with each request marked in its sampling
params, and collects what the worker harvested. The worker keeps a streamscope
envoy tree over its real model (built once), resolves the plan's values on it
exactly as a trace does, hooks the modules, and at every step reads the
scheduled requests' token spans off the model runner (`vllm_seam.scheduled_spans`:
the runner's batch order, the scheduler's token counts, each request's
computed tokens), so one hook call edits and reads the rows of every request
in the flattened batch. No nnsight trace runs on this path.

The RPCs are worker methods by name (`streamscope.vllm.bulk_worker.BulkRPC`),
which vLLM reaches whether the engine is in this process or another: every
engine streamscope starts carries them in its worker extension
(`streamscope.worker_extension.WorkerExtension`).
"""

from __future__ import annotations

import itertools
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm
from vllm import SamplingParams, envs

from .. import nnsight_seam as seam
from .. import vllm_seam
from ..blocks.sublayers import NEURONS
from ..bulk.apply import Applier, Span, steer_plans
from ..bulk.dose import SteerError
from ..bulk.moments import check_reduce, reduce_buffer
from ..bulk.results import Generation, Harvest, ShardCutter, ShardWriter, assemble, estimated_row_bytes
from ..bulk.schema import ONE_FORWARD
from ..bulk.spec import (HarvestSpec, Positions, Site, Steer, check_doses, check_steer, condition_sites,
                         generation_harvest, harvest_spec, locate, token_ids)
from ..errors import Unavailable, untapped
from . import graph_backend, held
from .families import envoy_tree, family_for
from .graphed import GraphedEdits
from .held import WorkerSAEs
from .pipeline import gather, holds, site_count, stage_sites

#: The sampling params' extra_args key that marks a request as a bulk run's, with its prompt index.
MARK = "streamscope_bulk"
_RUNS = itertools.count()


# ---------------------------------------------------------------- worker side


class WorkerState:
    """What a worker keeps for bulk runs: its envoy tree, the running applier, the request -> prompt map."""

    def __init__(self, runner: Any, model_type: str) -> None:
        self.runner = runner
        model = vllm_seam.model_of(runner)
        if getattr(runner, "nnsight_model", None) is None:
            # vLLM's own runner (an engine that keeps vLLM's compile: `compiled_workers`): a tree to find modules by,
            # the model's forwards left as vLLM built and compiled them (`graph_backend.build` does the same)
            self.root = seam.uninstrumented(model, lambda module: worker_tree(module, model_type))
        else:
            self.root = worker_tree(model, model_type)
        self.applier: Optional[Applier] = None
        self.run: Optional[int] = None
        self.keys: dict[str, int] = {}
        self.held: list[int] = []  # the run's harvest sites this worker's pipeline stage reads, in run order
        self.total = 0             # the run's harvest sites, every stage's
        self.logits: Optional[dict[int, list[torch.Tensor]]] = None
        self.reduce: Optional[str] = None  # the run's `HarvestSpec.reduce`
        self.sampled: list[Optional[int]] = []
        self.logits_hook: Any = None
        self.saes = WorkerSAEs(next(vllm_seam.model_of(runner).parameters()).device)  # `streamscope.vllm.held`
        vllm_seam.after_schedule(runner, self._step_scheduled)
        # On an engine that replays CUDA graphs, a replayed step runs no module call, so no hook fires: the bulk
        # work runs at each tap instead. A step that runs eagerly (a prefill) fires the hooks and reaches no tap,
        # so each step's work runs once either way.
        self.replays = seam.wrap_replay(getattr(getattr(runner, "nnsight_model", None), "interleaver", None),
                                        self._replayed)

    def _step_scheduled(self, scheduler_output: Any) -> None:
        applier = self.applier
        if applier is not None and applier.error is None:
            try:
                self.observe(scheduler_output)
            except Exception as error:  # noqa: BLE001  (the run's error, raised by the client; the engine serves on)
                applier.error = error

    def _replayed(self, original: Any, location: str, live: Any) -> Any:
        applier = self.applier
        if applier is not None:
            applier.apply_at(location, live)
        return original(location, live)

    def observe(self, scheduler_output: Any) -> None:
        """This step's spans, from the scheduler's token counts in the order of the runner's batch."""
        for request_id, extra, _ in vllm_seam.new_requests(scheduler_output):
            mark = extra.get(MARK)
            if mark is not None and mark[0] == self.run:
                self.keys[request_id] = mark[1]
        for request_id in vllm_seam.finished_requests(scheduler_output):
            self.keys.pop(request_id, None)
        if not self.applier.live and self.logits is None:
            # a run with nothing to apply or record (a plain `generate`): no spans to read; the step is still
            # claimed, so that the graph ops' plan resets what an earlier step marked
            self.sampled = []
            self.applier.step(())
            return
        computed = vllm_seam.computed_tokens(self.runner)
        keys = self.keys.get
        spans = [Span(keys(request_id), start, count, computed(request_id))
                 for request_id, start, count in vllm_seam.scheduled_spans(self.runner, scheduler_output)]
        self.sampled = [span.key for span in spans]
        self.applier.step(spans)

    def record_logits(self, _: Any, args: tuple, output: Any) -> None:
        # The logits processor runs on the sampled rows: one per scheduled request, in the spans' order.
        if self.applier is None or self.applier.error is not None or not isinstance(output, torch.Tensor):
            return
        rows = output.float()
        if rows.device.type != "cpu":
            rows = rows.to("cpu", non_blocking=True)
        for row, key in enumerate(self.sampled):
            if key is not None and row < rows.shape[0]:
                self.logits.setdefault(key, []).append(rows[row])


def worker_tree(module: torch.nn.Module, model_type: str) -> Any:
    """streamscope's envoy tree over the worker's real model: the same family envoys the client's tree has."""
    return envoy_tree(module, family_for(model_type))


def worker_root(worker: Any, model_type: str) -> Any:
    """The worker's envoy tree over its real model (`worker_tree`), built once per worker."""
    return _state(worker, model_type).root


def _state(worker: Any, model_type: str) -> WorkerState:
    runner = vllm_seam.runner_of(worker)
    state = runner.__dict__.get("_streamscope_bulk")
    if state is None:
        state = runner.__dict__["_streamscope_bulk"] = WorkerState(runner, model_type)
    return state


def worker_begin(worker: Any, payload: bytes) -> Any:
    """RPC: install a run's hooks on this worker's modules; None, or the error that stopped it (pickled for a client
    in another process), which the client raises as it is: an exception out of an RPC would reach the client as
    vLLM's bare ``Call to collective_rpc method failed``, after the worker logged it line by line."""
    try:
        _begin(worker, payload)
    except Exception as error:  # noqa: BLE001  (handed back to the caller, with its own type and message)
        state = vllm_seam.runner_of(worker).__dict__.get("_streamscope_bulk")
        if state is not None and state.applier is not None:
            worker_finish(worker, True)  # hooks a half-made run installed go
        return error if _in_process() else _pickled_error(error)
    return None


def _pickled_error(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001  (an exception that does not pickle travels as its type's name and message)
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def _begin(worker: Any, payload: bytes) -> None:
    plan = pickle.loads(payload)
    state = _state(worker, plan["model_type"])
    if state.applier is not None:
        worker_finish(worker, True)  # a run the client abandoned: its hooks go
    root = state.root
    state.saes.update(plan["ship"], plan["drop"])
    steers_in = unpack_vectors(plan["steers"], plan.get("vectors"))
    steer_list, readout = state.saes.take_in(steers_in, plan["harvest"].readout if plan["harvest"] else None)
    spec: Optional[HarvestSpec] = plan["harvest"]
    # Under pipeline parallelism this worker's stage reads and steers the blocks it holds (`vllm.pipeline`).
    sites, state.held = stage_sites(root, spec) if spec is not None else ([], [])
    state.total = site_count(spec) if spec is not None else 0
    device = next(vllm_seam.model_of(state.runner).parameters()).device
    dtype = vllm_seam.runner_dtype(state.runner)
    steers = [(steer, locate(root, steer.value, steer.layer)) for steer in steer_list
              if holds(root, steer.value, steer.layer)]
    keys = list(range(len(plan["lengths"])))
    plans = steer_plans(steers, keys, plan["lengths"], dtype, device, root=root)
    wanted = {key: spec.positions[key] for key in keys} if spec is not None else {}
    state.run, state.keys = plan["run"], {}
    state.reduce = spec.reduce if spec is not None else None  # applied to each prompt's rows before they leave
    try:
        applier = Applier(sites, wanted, plans, device, readout=readout,
                          graph=graph_backend.backend_for(state.runner))  # the ops inserted at load take theirs
    except graph_backend.LeftOnHooks as error:  # (the requests entered so far have left the plan)
        work = "; ".join(f"work at {where}" for where in error.where) or f"steers ({error})"
        raise SteerError(HOOKS_DO_NOT_FIRE.format(work=work, prompts=[error.key]), field="steer") from error
    if not plan.get("hooks_fire", True):
        try:
            refuse_hooked(applier)
        except BaseException:
            applier.close()  # its requests leave the graph ops' plan as they found it
            raise
    state.applier = applier.install()
    if state.replays and device.type == "cuda":
        state.applier.graphs = GraphedEdits()  # a replayed step's edits at its taps, captured per run
    state.logits = {} if plan["logits"] else None
    processor = getattr(vllm_seam.model_of(state.runner), "logits_processor", None)  # the last stage's only
    if plan["logits"] and processor is not None:
        state.logits_hook = processor.register_forward_hook(state.record_logits)


#: Why a bulk run is refused on an engine whose hooks do not fire, and the fix.
HOOKS_DO_NOT_FIRE = (
    "this engine keeps vLLM's compile (streamscope.load(..., graph_ops=True) with compilation on), where hooks do not "
    "fire, and its graph ops do not serve this run's {work} (prompts {prompts}): an SAE clamp or harvest, a "
    "conditional steer, a value without an op (a scaled or computed value, or one left out of graph_ops' values or "
    "harvest), more steers at one site than its rounds, steers out of the ops' order at one module call, or more "
    "distinct steers than its slots. Run it on an engine loaded with graph_ops=False or enforce_eager=True (hooks "
    "serve it), or load with graph_ops={{...}} naming more values, rounds or slots.")


def refuse_hooked(applier: Applier) -> None:
    """On an engine whose hooks do not fire, refuse a run whose requests left work to the hooks after the graph ops
    took what they serve (`graph_backend.GraphBackend.enter`): a `SteerError` naming the sites and the fix, raised
    before any request runs, never a run that is silently unsteered or unread."""
    steered: dict[str, list[Any]] = {}
    read: dict[str, list[Any]] = {}
    for key, live in applier.live.items():
        for entry in live.steers:
            steered.setdefault(entry.site.location, []).append(key)
        for site in live.harvest_sites:  # what the ops read left the request (`GraphBackend.enter`)
            read.setdefault(site.location, []).append(key)
    if not steered and not read:
        return
    work = "; ".join([f"steer at {where}" for where in sorted(steered)] + [f"harvest at {where}" for where in sorted(read)])
    prompts = sorted({key for keys in (*steered.values(), *read.values()) for key in keys})
    raise SteerError(HOOKS_DO_NOT_FIRE.format(work=work, prompts=prompts), field="steer" if steered else "harvest")


def worker_release(worker: Any, keys: list[str]) -> None:
    """RPC: let go of the SAEs held under `keys` (`streamscope.vllm.held`)."""
    state = vllm_seam.runner_of(worker).__dict__.get("_streamscope_bulk")
    if state is not None:
        state.saes.update({}, keys)


def worker_finish(worker: Any, inline: bool) -> Any:
    """RPC: remove the run's hooks; hand back each prompt's harvested tensors and logits, and any hook error."""
    state = vllm_seam.runner_of(worker).__dict__.get("_streamscope_bulk")
    if state is None or state.applier is None:
        return None
    applier = state.applier
    applier.remove()
    if state.logits_hook is not None:
        state.logits_hook.remove()
        state.logits_hook = None
    if torch.cuda.is_available():
        # The logits' non-blocking copies (`record_logits`, on the compute stream) are complete; the run is over, so
        # no step waits behind this. The harvested rows' copies run on the applier's side stream, which `settle`
        # waits for on its own event (mid-run too, where a caller takes a request's rows early).
        torch.cuda.synchronize()
    applier.settle()
    keys = list(applier.harvested)
    result = {
        "harvested": {key: reduce_buffer(applier.take(key), state.reduce) for key in keys},
        "logits": {key: torch.stack(rows) for key, rows in (state.logits or {}).items()},
        "error": applier.error,
        "held": state.held,
        "sites": state.total,
    }
    applier.close()  # its requests leave the graph ops' plan, which outlives the run
    state.applier, state.run, state.logits, state.keys = None, None, None, {}
    return result if inline else pickle.dumps(result)


# ---------------------------------------------------------------- client side


#: From this many steers a run's plan carries their vectors stacked in one tensor (`pack_vectors`).
PACKED_STEERS = 8


def pack_vectors(steers: list[Steer]) -> tuple[list[Steer], Optional[tuple[torch.Tensor, list[int]]]]:
    """Many steers' vectors as one ``[distinct vectors, width]`` tensor with each steer's row of it, and the steers
    with empty vectors in their place.

    The plan travels pickled, and a tensor pickles as a file of its own: hundreds of steers (a patch each) would
    cost a save and a load apiece. Steers that hold one tensor (a direction at every block) share its row, so that
    the worker makes their operation once (`streamscope.bulk.apply.steer_plans`). Steers of differing widths or
    dtypes, or few of them, go as they are (None).
    """
    vectors = [steer.vector for steer in steers]
    if len(steers) < PACKED_STEERS or len({(tuple(v.shape), v.dtype, v.device) for v in vectors}) != 1:
        return steers, None

    distinct: dict[int, int] = {}
    rows = [distinct.setdefault(id(vector), len(distinct)) for vector in vectors]
    table = torch.stack([vector.detach() for vector in {id(vector): vector for vector in vectors}.values()])
    empty = vectors[0].new_empty(0)
    return [replace(steer, vector=empty) for steer in steers], (table, rows)


def unpack_vectors(steers: list[Steer], packed: Optional[tuple[torch.Tensor, list[int]]]) -> list[Steer]:
    """`pack_vectors` undone in the worker: each steer with its row of the table, steers of one row holding one
    tensor (None: as they came)."""
    if packed is None:
        return steers

    table, rows = packed
    views = list(table)
    return [replace(steer, vector=views[row]) for steer, row in zip(steers, rows)]


def _check_tapped(model: Any, sites: Sequence[Site]) -> None:
    """On an engine that replays CUDA graphs, every site must be tapped; else `Unavailable` with the fix."""
    tapped = getattr(model, "tapped", None)
    if not tapped:
        return
    for site in sites:
        if site.location not in tapped:
            name = f"{site.host.where()}.{site.descriptor.name}"
            raise Unavailable(site.descriptor.name, site.host.where(), untapped(name, site.location, len(tapped)))


def _check_whole_prompts(model: Any, steers: Sequence[Steer]) -> None:
    """Refuse a request-scoped condition on an engine that may run a prompt in pieces: it decides on the whole
    prompt in the step that runs it (`streamscope.bulk.conditions.deciding_rows`)."""
    if not any(steer.condition is not None and steer.condition.scope == "request" for steer in steers):
        return
    if vllm_seam.chunked_prefill(model.vllm_entrypoint):
        raise SteerError("a request-scoped condition decides on the whole prompt in the step that runs it, and this "
                         "engine may run a prompt in pieces (enable_chunked_prefill=True): load the model without "
                         "enable_chunked_prefill (streamscope's default), or use Condition(scope='row').",
                         field="condition")


def _rpc(model: Any, method: str, *args: Any) -> Any:
    return model.vllm_entrypoint.collective_rpc(method, args=args)[0]


def _dtype(model: Any) -> torch.dtype:
    """The engine's dtype, which a steer's edit must fit (`streamscope.bulk.spec.check_dose`)."""
    return vllm_seam.engine_dtype(model.vllm_entrypoint)


def _in_process() -> bool:
    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


def _run(model: Any, ids: list[list[int]], chunk: list[int], sampling: dict[str, Any], spec: Optional[HarvestSpec],
         steers: Sequence[Steer], logits: bool) -> tuple[list[Any], dict]:
    """One chunk of prompts through the engine with the run's hooks; (request outputs, worker results)."""
    run = next(_RUNS)
    local = {global_index: local_index for local_index, global_index in enumerate(chunk)}
    chunk_spec = None
    if spec is not None:
        chunk_spec = HarvestSpec(spec.values, spec.layers, [spec.positions[index] for index in chunk], spec.readout,
                                 reduce=spec.reduce)
    chunk_steers = []
    for steer in steers:
        if steer.prompts is None:
            chunk_steers.append(steer)
        else:
            mine = [local[index] for index in steer.prompts if index in local]
            if mine:
                chunk_steers.append(_with_prompts(steer, mine))
    # An SAE travels by key once the workers hold it (`streamscope.vllm.held`): its weights cross once.
    chunk_steers, readout, ship, drop, used = held.swap_out(model, chunk_steers,
                                                            chunk_spec.readout if chunk_spec is not None else None)
    if chunk_spec is not None:
        chunk_spec.readout = readout
    chunk_steers, vectors = pack_vectors(chunk_steers)
    plan = {"run": run, "model_type": model.config.model_type, "harvest": chunk_spec, "steers": chunk_steers,
            "vectors": vectors, "lengths": [len(ids[index]) for index in chunk], "logits": logits, "ship": ship,
            "drop": drop, "hooks_fire": getattr(model, "hooks_fire", True)}
    inline = _in_process()
    for failed in model.vllm_entrypoint.collective_rpc("streamscope_bulk_begin", args=(pickle.dumps(plan),)):
        if failed is not None:
            model.vllm_entrypoint.collective_rpc("streamscope_bulk_finish", args=(inline,))  # every rank's hooks go
            raise failed if isinstance(failed, BaseException) else pickle.loads(failed)
    held.record(model, used, drop)
    try:
        params = [SamplingParams(**sampling, extra_args={MARK: (run, local_index)}) for local_index in range(len(chunk))]
        prompts = [{"prompt_token_ids": ids[index]} for index in chunk]
        for local_index in _salted(model, chunk_spec, chunk_steers, len(chunk)):
            # Its own cache salt: under prefix caching a steered or harvested request neither reuses KV blocks
            # computed under another steer (or none) nor skips the prompt positions a harvest reads.
            prompts[local_index]["cache_salt"] = f"streamscope-{os.getpid()}-{run}-{local_index}"
        outputs = model.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
    finally:
        results = model.vllm_entrypoint.collective_rpc("streamscope_bulk_finish", args=(inline,))
    # Every worker's part: under pipeline parallelism each stage read its own blocks (`vllm.pipeline.gather`).
    result = gather([item if inline or item is None else pickle.loads(item) for item in results])
    if result["error"] is not None:
        raise result["error"]
    return outputs, result


def _salted(model: Any, spec: Optional[HarvestSpec], steers: Sequence[Steer], count: int) -> list[int]:
    """The requests of a chunk that need a cache salt of their own: with prefix caching on, every one a steer or a
    harvest touches (the others may share cached blocks, as plain vLLM's requests do)."""
    if not vllm_seam.prefix_caching(model.vllm_entrypoint):
        return []
    if spec is not None or any(steer.prompts is None for steer in steers):
        return list(range(count))
    return sorted({index for steer in steers for index in steer.prompts or ()})


def settable(model: Any, value: str, layer: int) -> Optional[str]:
    """None where `set_each` can set `value` (a name as `model.harvest` takes it) of block `layer`, else why not."""
    if value.split(".")[-1] in NEURONS and model.tensor_parallel_size > 1:
        return (f"under tensor parallelism each of the {model.tensor_parallel_size} ranks holds a share of the MLP's "
                f"neurons, and a bulk set writes {value} whole")
    try:
        site = locate(model, value, layer)
        _check_tapped(model, [site])
    except (ValueError, AttributeError, Unavailable) as error:
        return str(error)
    return None


def set_each(model: Any, prompt: str, edits: Sequence[tuple[str, int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """`prompt` run once per edit, every run a request of one bulk run: each request's own steer sets one value at
    one position, and the request's last position's logits ``[vocab_size]`` (float32, on the CPU) come back.

    An edit ``(value, layer, position, vector)`` sets `value` of block `layer` at prompt position `position` to
    `vector` (``[width]``): a ``set`` `Steer` of that one request, prompt only, written as a trace's
    ``model.layers[layer].<value>[:, position] = vector`` is (`Site.edit_rows`: the other rows, and the other
    requests of the step, keep their values bit for bit). The logits are the engine's own of the sampled
    position (its logits processor's output, which a trace reads as ``model.logits``). `settable` says which
    values this serves; the patching workflow runs each patch of them this way (`streamscope.patch`).
    """
    if not edits:
        return []
    ids = token_ids(model, [prompt])[0]
    for value, layer in dict.fromkeys((value, layer) for value, layer, _, _ in edits):
        reason = settable(model, value, layer)
        if reason is not None:
            raise Unavailable(value, f"model.layers[{layer}]", f"a bulk run cannot set it: {reason}")
    # Every vector to the host in one copy; the plan carries them stacked (`pack_vectors`).
    vectors = torch.stack([vector.detach().reshape(-1) for _, _, _, vector in edits]).cpu()
    steers = [Steer(value, layer, vectors[index], mode="set", positions=[position], generated=False, prompts=[index])
              for index, (value, layer, position, _) in enumerate(edits)]
    _, result = _run(model, [ids] * len(edits), list(range(len(edits))), dict(ONE_FORWARD), None, steers, True)
    return [result["logits"][index][-1] for index in range(len(edits))]


def release_saes(model: Any, sae: Any = None) -> None:
    """Let the engine's workers drop their copy of `sae` (every SAE they hold where None) now."""
    keys = held.forget(model, sae)
    if keys and getattr(model, "vllm_entrypoint", None) is not None:
        model.vllm_entrypoint.collective_rpc("streamscope_bulk_release", args=(keys,))


def _with_prompts(steer: Steer, prompts: list[int]) -> Steer:
    return replace(steer, prompts=prompts)


def _chunks(count: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def harvest(model: Any, prompts: Sequence[Any], values: Any, layers: Any = None, positions: Positions = "last",
            out: Optional[str | Path] = None, shard_size: Optional[int] = None, progress: bool = True,
            readout: Any = None, steer: Sequence[Steer] = (), reduce: Optional[str] = None) -> Harvest | Path:
    """Read values at chosen blocks and positions of many prompts in the engine's own batches; see `streamscope.bulk`.

    `reduce` (``"last"``, ``"mean"``) reduces each prompt's positions in the worker, before its rows leave it
    (`streamscope.bulk.moments.reduce_positions`): one row a prompt crosses to this process.
    The engine runs `shard_size` prompts at a time, each run a shard of `out`; by default as many as hold
    `streamscope.bulk.results.SHARD_BYTES` of rows (1 GiB), at most 1,024 (`ShardCutter`).
    """
    ids = token_ids(model, prompts)
    spec = harvest_spec(model, values, layers, positions, [len(tokens) for tokens in ids])
    spec.readout = readout
    spec.reduce = check_reduce(reduce)
    lengths = [len(tokens) for tokens in ids]
    _check_tapped(model, spec.sites(model) + [check_steer(model, item, len(ids), lengths) for item in steer]
                  + condition_sites(model, steer))
    _check_whole_prompts(model, steer)
    dtype = _dtype(model)
    steer = check_doses(model, list(steer), dtype)  # a clamped dose's steer replaced
    shards = ShardCutter(spec, len(ids), shard_size, estimated_row_bytes(spec, model.hidden_size, dtype))
    writer = ShardWriter(out, spec, len(ids)) if out is not None else None
    parts: list[Harvest] = []
    bar = tqdm(total=len(ids), desc="harvest", unit="prompt", disable=not progress)
    try:
        for chunk in shards:
            _, result = _run(model, ids, chunk, dict(ONE_FORWARD), spec, steer, False)
            part = assemble(spec, [result["harvested"].get(local) for local in range(len(chunk))], chunk)
            shards.measure(part)
            if writer is not None:
                writer.write(part)
            else:
                parts.append(part)
            bar.update(len(chunk))
    except BaseException:
        if writer is not None:
            writer.abort()  # a half harvest gets no index, and the writer thread ends
        raise
    finally:
        bar.close()
    if writer is not None:
        return writer.close()
    return Harvest({value: [tensor for part in parts for tensor in part.values[value]] for value in spec.values},
                   spec.layers, spec.positions, list(range(len(ids))), spec.reduce)


def generate(model: Any, prompts: Sequence[Any], max_tokens: int = 16, *, steer: Sequence[Steer] = (),
             harvest: Optional[dict[str, Any]] = None, return_logits: bool = False, chunk_size: int = 4096,
             progress: bool = True, **sampling: Any) -> Generation:
    """Sample many completions with steers applied and values harvested; see `streamscope.bulk`.

    `sampling` is vLLM's ``SamplingParams`` (``temperature``, ``top_p``, ``seed``, ``ignore_eos``, ...).
    """
    ids = token_ids(model, prompts)
    lengths = [len(tokens) for tokens in ids]
    spec = generation_harvest(model, harvest, lengths)
    _check_tapped(model, [check_steer(model, item, len(ids), lengths) for item in steer]
                  + (spec.sites(model) if spec else []) + condition_sites(model, steer))
    _check_whole_prompts(model, steer)
    steer = check_doses(model, list(steer), _dtype(model))  # a clamped dose's steer replaced
    sampling = {"temperature": 0.0, **sampling, "max_tokens": max_tokens}
    tokens: list[list[int]] = []
    texts: list[str] = []
    logits: list[torch.Tensor] = []
    collected: list[Any] = []
    bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=not progress)
    try:
        for chunk in _chunks(len(ids), chunk_size):
            outputs, result = _run(model, ids, chunk, sampling, spec, steer, return_logits)
            for local, output in enumerate(outputs):
                completion = output.outputs[0]
                tokens.append(list(completion.token_ids))
                texts.append(completion.text)
                if return_logits:
                    logits.append(result["logits"][local][:len(completion.token_ids)])
                if spec is not None:
                    collected.append(result["harvested"].get(local))
            bar.update(len(chunk))
    finally:
        bar.close()
    harvested = assemble(spec, collected, list(range(len(ids)))) if spec is not None else None
    return Generation(tokens, texts, logits if return_logits else None, harvested)
