"""A steer, its condition and a harvest request, declared once: their JSON fields, types, defaults and limits.

The pydantic models here are the one statement of what a steer
(`SteerJSON`, with its `ConditionJSON`) and a harvest request
(`HarvestJSON`) hold as data, and of the limits their fields obey (the modes,
the dose actions, the positions rules, the reductions, the comparisons). From
them come:

* the server's JSON schema (`request_schema`, served at
  ``GET /v1/streamscope/schema``);
* the server's check of each field's type and range (`validate_fields`), whose
  refusal names the field's path (``streamscope.steer[0].from_step``) and what
  the field takes; what needs the model (a value's site, a vector's width, a
  stored name, a dose) the server checks after it, on its model;
* the field names every encoding and decoding uses (`STEER_FIELDS`,
  `CONDITION_FIELDS`, `HARVEST_FIELDS`, `REQUEST_FIELDS`): `Steer.to_dict` /
  `from_dict`, the client's request, the server's plan for its worker and the
  worker's reading of it.

`streamscope.Steer` and `streamscope.Condition` stay the public dataclasses:
their fields are these models' fields (tests/test_operations_declared.py holds them equal),
and their `validate` methods run the in-process checks that need Python
objects (a tensor, an SAE).
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Callable, Optional, Sequence, Union, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from .conditions import COMPARES, MEASURES, SCOPES
from .operations import MODES
from .positions import RULES, SKIP_FIRST, Positions

#: A steer's default dose limit: the edit's size over the stream's own norm at the steered value and block
#: (`check_dose`). Steering is usually done at doses up to about 10-20; past this the stream is the vector.
MAX_DOSE = 100.0
#: What a steer's dose past its limit does (`Steer.on_dose`); the first is the default.
DOSE_ACTIONS = ("refuse", "clamp", "warn")
#: How a harvest's positions may be reduced where they are read: the last one, or their mean.
REDUCTIONS = ("last", "mean")
#: A harvest's default positions rule: the prompt's last position.
HARVEST_POSITIONS = "last"
#: The sampling settings of a request that runs its prompt through one forward pass and stops (greedy, one token):
#: a harvest's, a calibration's, the vLLM engine's trace (`streamscope.vllm.engine` takes it from here);
#: tests/test_operations_declared.py fails on a module that spells the pair again.
ONE_FORWARD: dict[str, Any] = {"temperature": 0.0, "max_tokens": 1}
#: A steer's fields that only a run in process has: a server request is one prompt, which the client sends with
#: that prompt's own steers.
PER_PROMPT = ("prompts",)
#: A steer's fields the server's front end settles and its worker never reads: the dose (checked, or clamped, before
#: the request runs) and the shape of the model the vector was made on.
FRONT_END_ONLY = ("origin", "max_dose", "on_dose")
#: A steer's fields each form writes in its own way: the vector (a list, a stored name, base64 for the worker), the
#: positions (a slice as ``{"slice": [...]}``), the condition (its own object), the SAE (by its stored name) and its
#: feature (sent with the SAE only).
ENCODED = ("vector", "positions", "condition", "sae", "feature")


def _one_of(names: Sequence[str], what: str) -> Callable[[Any], Any]:
    def check(raw: Any) -> Any:
        if raw not in names:
            raise ValueError(f"{what} {raw!r} is not one of {', '.join(map(repr, names))}.")
        return raw
    return check


def _enum(names: Sequence[str], meaning: str) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "enum": list(names), "description": meaning})


def positions_from_json(raw: Any) -> Positions:
    """A JSON positions rule as `Steer` and `harvest` take it: ``"all_but_first"``, ``"all"``, ``"last"``,
    ``"none"``, a non-empty list of ints, or ``{"slice": [start, stop, step]}`` (a `slice`); a ValueError naming the
    rules otherwise."""
    if raw in RULES:
        return str(raw)
    if isinstance(raw, list) and raw and all(isinstance(item, int) and not isinstance(item, bool) for item in raw):
        return list(raw)
    if isinstance(raw, dict) and set(raw) == {"slice"} and isinstance(raw["slice"], list) and len(raw["slice"]) <= 3 \
            and all(item is None or (isinstance(item, int) and not isinstance(item, bool)) for item in raw["slice"]):
        if len(raw["slice"]) == 3 and raw["slice"][2] == 0:
            raise ValueError("a slice's step cannot be 0.")
        return slice(*raw["slice"])
    raise ValueError(f"{json.dumps(raw)[:80]} is not a positions rule: use \"all_but_first\" (a steer's default: "
                     "every prompt position but the first), \"all\", \"last\", \"none\" (a steer's generated tokens "
                     "only), a non-empty list of indices (negative from the prompt's end), or "
                     "{\"slice\": [start, stop, step]}.")


def rule_json(positions: Any) -> Any:
    """`positions` (as `streamscope.Steer` and `harvest` take them) as the JSON rule `positions_from_json` reads."""
    if isinstance(positions, slice):
        return {"slice": [positions.start, positions.stop, positions.step]}
    if isinstance(positions, range):
        return list(positions)
    if isinstance(positions, int):
        return [positions]
    return list(positions) if isinstance(positions, (list, tuple)) else positions


def _rule(raw: Any) -> Any:
    positions_from_json(raw)
    return raw


_SLICE = {"type": "object", "properties": {"slice": {"type": "array", "maxItems": 3,
                                                     "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
          "required": ["slice"], "additionalProperties": False}
#: A positions rule as JSON (see `positions_from_json`).
PositionsJSON = Annotated[Any, BeforeValidator(_rule), WithJsonSchema({
    "anyOf": [{"type": "string", "enum": list(RULES)}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
              _SLICE],
    "description": "Which prompt positions: a rule, indices (negative from the prompt's end), or a slice."})]
#: A finite number (JSON has no NaN or infinity, and a careless client may still send them).
Finite = Annotated[float, Field(allow_inf_nan=False)]
#: A block index (negative counts from the end), or null for a root value (token_embeddings, final_norm_output).
Layer = Annotated[Optional[int], Field(description="The block (negative from the end); null for a root value.")]
#: A vector: its numbers (``hidden_size`` of them), or the name of a vector stored on the server.
Vector = Annotated[Union[list[float], str], Field(description="hidden_size numbers, or a stored vector's name.")]


#: The declared choices: each a string field that takes one of its tuple's names, refused naming them.
Compare = Annotated[str, AfterValidator(_one_of(COMPARES, "compare")),
                    _enum(COMPARES, "greater: passes where measure > threshold; less: where <.")]
Measure = Annotated[str, AfterValidator(_one_of(MEASURES, "measure")),
                    _enum(MEASURES, "projection (h . u) or cosine (h . u / |h|).")]
Scope = Annotated[str, AfterValidator(_one_of(SCOPES, "scope")),
                  _enum(SCOPES, "row: each token decides; request: the prompt's mean stream, once.")]
Mode = Annotated[str, AfterValidator(_one_of(MODES, "mode")),
                 _enum(MODES, "The operation (streamscope.bulk.operations): add x + scale v, set scale v, ablate "
                              "x - scale (x . d) d, clamp x + (projection - x . d) d, sae_clamp an SAE's feature.")]
DoseAction = Annotated[str, AfterValidator(_one_of(DOSE_ACTIONS, "on_dose")),
                       _enum(DOSE_ACTIONS, "What a dose past max_dose does; on the server, its --steer-dose-action "
                                           "where left out.")]
Reduction = Annotated[str, AfterValidator(_one_of(REDUCTIONS, "reduce")),
                      _enum(REDUCTIONS, "last position, or the mean of the positions; null: every position.")]


class _Declared(BaseModel):
    # strict: "yes" is not a boolean and "5" not a number; extra: an unknown field is refused, never ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


class ConditionJSON(_Declared):
    """A steer's condition (`streamscope.Condition`): the steer edits only where the measure passes the threshold."""

    value: str = Field(description="The value the condition reads, as a steer names values.")
    layer: Layer = None
    vector: Vector = Field(description="The condition direction: hidden_size numbers or a stored vector's name.")
    threshold: Finite = Field(description="The number the measure is compared with.")
    compare: Compare = "greater"
    measure: Measure = "projection"
    scope: Scope = "row"


class SteerJSON(_Declared):
    """A steer (`streamscope.Steer`) as data: one value of one block edited at chosen positions."""

    value: str = Field(description="A block's value (layer_output, mlp.mlp_output, ...) or a root value.")
    layer: Layer = None
    vector: Vector = Field(description="The vector to add or set, or the direction to ablate or clamp (any length).")
    scale: Optional[Finite] = Field(None, description="add/set: the multiple of the vector; ablate: the fraction "
                                                       "removed. Null: 1; clamp and sae_clamp refuse it.")
    positions: PositionsJSON = SKIP_FIRST
    mode: Mode = "add"
    generated: bool = Field(True, description="Whether generated tokens are steered too (true or false).")
    prompts: Optional[list[int]] = Field(None, description="In process only: the prompts steered (null: all).")
    projection: Optional[Finite] = Field(None, description="clamp: the projection each row gets (null: 0); "
                                                            "sae_clamp: the feature's value. Other modes refuse it.")
    norm_match: bool = Field(False, description="After the edit, rescale each row to its norm before (true or "
                                                "false).")
    from_step: int = Field(0, ge=0, description="The first generated token steered, an int >= 0 (0: every one).")
    origin: Optional[dict[str, Any]] = Field(None, description="The shape of the model the vector was made on "
                                                               "(model_type, hidden_size, num_layers, vocab_size), "
                                                               "and the stream norm it carries.")
    sae: Optional[str] = Field(None, description="sae_clamp (or a steer by feature): a stored SAE's name.")
    feature: Optional[int] = Field(None, ge=0, description="The SAE's feature index.")
    max_dose: Optional[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        MAX_DOSE, description="The largest dose, |edit| / ||h||, a positive finite number (null: no limit, in "
                              "process); on the server, its --max-steer-dose where left out.")
    on_dose: DoseAction = "refuse"
    condition: Optional[ConditionJSON] = Field(None, description="Where the steer applies (streamscope.Condition).")


class HarvestJSON(_Declared):
    """A harvest request: which values, at which blocks, at which positions of the prompt; or an SAE's features."""

    values: Optional[Union[str, Annotated[list[str], Field(min_length=1)]]] = Field(
        None, description="A value name or a non-empty list of them (not with sae).")
    layers: Optional[Union[int, list[int]]] = Field(None, description="A block index, a list, or null for every "
                                                                      "block.")
    positions: PositionsJSON = HARVEST_POSITIONS
    keep: bool = Field(False, description="Keep the harvest on the server after its first download.")
    sae: Optional[str] = Field(None, description="A stored SAE whose features are harvested at its own site.")
    top_k: Optional[int] = Field(None, ge=1, description="With sae: the top_k largest features (values, indices).")
    reduce: Optional[Reduction] = None


class RequestJSON(_Declared):
    """The ``streamscope`` field of a completion or chat request."""

    steer: Union[SteerJSON, list[SteerJSON]] = Field(default_factory=list, description="The request's steers.")
    harvest: Optional[HarvestJSON] = None
    default_steer: bool = Field(True, description="Whether the server's default steers apply too.")


#: Each model's fields, in order: the one list every encoding and decoding reads.
STEER_FIELDS = tuple(SteerJSON.model_fields)
CONDITION_FIELDS = tuple(ConditionJSON.model_fields)
HARVEST_FIELDS = tuple(HarvestJSON.model_fields)
REQUEST_FIELDS = tuple(RequestJSON.model_fields)
#: A harvest request's fields the server's front end settles (its storage) and its worker never reads.
HARVEST_FRONT_END_ONLY = ("keep",)
#: The harvest request's fields the worker's plan carries (with the harvest's id, which the server gives it).
WORKER_HARVEST_FIELDS = tuple(name for name in HARVEST_FIELDS if name not in HARVEST_FRONT_END_ONLY)
#: The steer's fields a server request takes (one request is one prompt).
SERVED_STEER_FIELDS = tuple(name for name in STEER_FIELDS if name not in PER_PROMPT)
#: The steer's fields the worker's plan carries as they are (the others: `ENCODED`, or settled by the front end).
PLAIN_FIELDS = tuple(name for name in STEER_FIELDS if name not in PER_PROMPT + FRONT_END_ONLY + ENCODED)
#: A steer's fields that have no default: a steer names them (a server's steer by an SAE's feature takes them from
#: the SAE).
STEER_REQUIRED = tuple(name for name, info in SteerJSON.model_fields.items() if info.is_required())
#: A steer's fields whose JSON null means "left out": the mode's default where the mode uses it.
NULL_IS_LEFT_OUT = tuple(name for name, info in SteerJSON.model_fields.items() if info.default is None)


def request_schema() -> dict[str, Any]:
    """The JSON schema of a request's ``streamscope`` field (steers, their conditions, the harvest)."""
    return RequestJSON.model_json_schema()


def _nested(annotation: Any) -> Optional[type[BaseModel]]:
    """The declared model a field holds (a condition in a steer), if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for found in map(_nested, get_args(annotation)) if found is not None), None)


def _refusal(model: type[BaseModel], error: ValidationError) -> tuple[str, str]:
    """The field path a pydantic refusal is about (``condition.scope``), and what it says: the check's own words, or
    what the field takes."""
    first = error.errors(include_url=False)[0]
    names: list[str] = []
    owner: type[BaseModel] = model
    inner: Optional[type[BaseModel]] = model
    for part in first["loc"]:
        if inner is None or not isinstance(part, str) or part not in inner.model_fields:
            break
        names.append(part)
        owner, inner = inner, _nested(inner.model_fields[part].annotation)
    path = ".".join(names)
    if first["type"] == "value_error":
        return path, str(first["ctx"]["error"])
    if first["type"] == "missing" and names:
        return path, f"a {owner.__name__.removesuffix('JSON').lower()} needs {names[-1]!r}: its fields are " \
                     f"{', '.join(owner.model_fields)}."
    info = owner.model_fields[names[-1]] if names else None
    meaning = f" {info.description}" if info is not None and info.description else ""
    shown = json.dumps(first["input"], default=repr)[:80] if "input" in first else "nothing"
    return path, f"{first['msg'][0].upper()}{first['msg'][1:]}, not {shown}.{meaning}"


def validate_fields(model: type[BaseModel], raw: dict[str, Any]) -> tuple[Optional[BaseModel], str, str]:
    """`raw` checked against `model`: ``(the model's instance, "", "")``, or ``(None, field, message)`` for the first
    field that does not fit, the message saying what the field takes."""
    try:
        return model.model_validate(raw), "", ""
    except ValidationError as error:
        name, message = _refusal(model, error)
        return None, name, message


#: Each model's instance of its defaults, built once: `model_construct` costs about 60 us (it inspects each default
#: factory's signature), and the server's front end checks 17 fields of a steer, on the event loop.
_DEFAULTS: dict[type[BaseModel], BaseModel] = {}


#: Each (model, field, plain value)'s verdict, once checked: a server's requests send the same few values (true,
#: "refuse", a dose limit) over and over, and a check through pydantic costs about 20 us (a copy of the defaults and
#: an assignment), a steer's 17 fields a request on the front end's event loop.
_VERDICTS: dict[tuple[Any, ...], Optional[str]] = {}
_PLAIN = (bool, int, float, str, type(None))


def validate_field(model: type[BaseModel], name: str, raw: Any) -> Optional[str]:
    """One field of `model` checked alone: None where `raw` fits, else what the field takes."""
    key = (model, name, type(raw), raw) if type(raw) in _PLAIN else None  # (type: True and 1 are equal keys)
    if key is not None and key in _VERDICTS:
        return _VERDICTS[key]
    defaults = _DEFAULTS.get(model)
    if defaults is None:
        defaults = _DEFAULTS[model] = model.model_construct()
    verdict = None
    try:  # on a copy of the defaults: the assignment changes the instance it checks
        model.__pydantic_validator__.validate_assignment(copy.copy(defaults), name, raw)
    except ValidationError as error:
        verdict = _refusal(model, error)[1]
    if key is not None:
        if len(_VERDICTS) >= 4096:  # (a client sending ever new numbers cannot grow it without bound)
            _VERDICTS.clear()
        _VERDICTS[key] = verdict
    return verdict


__all__ = ["CONDITION_FIELDS", "ConditionJSON", "DOSE_ACTIONS", "ENCODED", "FRONT_END_ONLY", "HARVEST_FIELDS",
           "HARVEST_FRONT_END_ONLY", "HARVEST_POSITIONS", "HarvestJSON", "MAX_DOSE", "NULL_IS_LEFT_OUT", "ONE_FORWARD", "PER_PROMPT",
           "PLAIN_FIELDS", "REDUCTIONS", "REQUEST_FIELDS", "RequestJSON", "SERVED_STEER_FIELDS", "STEER_FIELDS",
           "STEER_REQUIRED", "SteerJSON", "WORKER_HARVEST_FIELDS", "positions_from_json", "request_schema",
           "rule_json", "validate_field", "validate_fields"]
