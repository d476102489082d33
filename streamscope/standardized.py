"""What every standardized model serves at its root, whichever engine runs it."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from transformers import AutoConfig

from .blocks.envoy import Blocks, StreamEnvoy
from .bulk.moments import statistics
from .bulk.norms import norms
from .engine import Engine, trace_prompts
from .errors import Unavailable, UnsupportedCheckpoint
from .families.spec import ROOT_ORDER, spec_of
from .support import BlockSupport, ModelSupport
from .values import OUTPUT, Relocation, StreamValue
from .workflows.cache import build_cache
from .workflows.runs import run_with_cache, run_with_hooks
from .workflows.tl import to_single_token, to_str_tokens, to_tokens

if TYPE_CHECKING:
    from .families.spec import FamilySpec


class Standardized(StreamEnvoy):
    """The root of a standardized model: the family's names, the sizes, the root values and support.

    Mixed into an engine's nnsight model class; the family module (found by
    ``config.model_type``) is `family`, what it states `family_spec`. Each
    engine adds `logits` its own way, and names its `Engine` class
    (`ENGINE_CLASS`): what the workflows ask of the engine goes through
    `model.engine`, never through a test of which engine this is.
    """

    family: ModuleType
    ORDER = ROOT_ORDER
    #: The engine's `streamscope.engine.Engine` subclass, set by each engine's model class (a tree built without
    #: an engine, as a vLLM worker's, has the base: it names no engine and runs nothing).
    ENGINE_CLASS: type[Engine] = Engine

    @property
    def engine(self) -> Engine:
        """The engine running this model, as the workflows use it (`streamscope.engine.Engine`): built once."""
        engine = self.__dict__.get("_streamscope_engine")
        if engine is None:
            engine = self.__dict__["_streamscope_engine"] = self.ENGINE_CLASS(self)
        return engine

    def _take_family(self, path: Any, family: str | ModuleType | None, families: ModuleType,
                     settings: dict[str, Any], envoys: dict) -> dict[str, Any]:
        """Take the model's family and say how nnsight builds the tree: both engines' one setup path.

        `family` is a family module, a model type's name, or None for the
        family of the checkpoint's ``config.model_type``, found in the
        engine's `families` package. Its spec is checked (`spec_of`), and it is
        set on the model before the tree is built: the root's values consult
        it. Returns the caller's `settings` over the family's engine defaults
        and those its checkpoint needs (`FamilySpec.checkpoint_defaults`),
        with its ``rename=`` and ``envoys=`` (the family's kinds as the engine
        composes them, ``families.envoys_for``, over the engine's own `envoys`)
        where the caller gave none. `_check_family` runs once the tree is built.
        """
        module: ModuleType
        config = None
        if isinstance(family, str):
            module = families.family_called(family)
        elif family is None:
            config = _config(path, settings)
            module = families.family_for(config.model_type)
        else:
            module = family
        spec = spec_of(module)
        defaults = dict(spec.engine_defaults)
        if spec.cannot_run is not None or spec.checkpoint_defaults is not None:
            config = config if config is not None else _config(path, settings)
            reason = spec.cannot_run(config) if spec.cannot_run is not None else None
            if reason is not None:
                raise UnsupportedCheckpoint(f"{path}: {reason}")
            if spec.checkpoint_defaults is not None:
                defaults.update(spec.checkpoint_defaults(config, settings))
        object.__setattr__(self, "family", module)
        settings = {**defaults, **settings}
        settings.setdefault("rename", spec.rename)
        settings.setdefault("envoys", {**envoys, "layers": Blocks, **families.envoys_for(spec)})
        return settings

    def _check_family(self) -> None:
        """A family may check the tree it was applied to (the default says what it could not map)."""
        check: Optional[Callable[[Any], None]] = self.family_spec.check
        if check is not None:
            check(self)

    @property
    def family_spec(self) -> "FamilySpec":
        """What the model's family states: its names, envoys and exceptions (`streamscope.families.FamilySpec`)."""
        return self.family.SPEC

    @StreamValue("embed_tokens", OUTPUT)
    def token_embeddings(self) -> torch.Tensor:
        """The token embeddings, after any scaling the family applies, [batch, seq, hidden_size].

        Before position embeddings are added (GPT-2, OPT). In-place edits and
        assignment reach the model.
        """

    @StreamValue("norm", OUTPUT)
    def final_norm_output(self) -> torch.Tensor:
        """The final norm's output, what the unembedding reads, [batch, seq, hidden_size]."""

    def where(self) -> str:
        return "model"

    def relocated(self) -> dict[str, Relocation]:
        return dict(self.family_spec.root_sites)

    def reason(self, name: str) -> Optional[str]:
        return self.family_spec.unserved.get(name)

    # Sizes, read off the config under the family's spelling of them.

    def _size(self, name: str, *attributes: str) -> int:
        reason = self.reason(name)  # a family's unserved may name sizes too (Mamba: no heads)
        if reason is not None:
            raise Unavailable(name, "model", reason)
        config = self.config
        for attribute in attributes:
            value = getattr(config, attribute, None)
            if value is not None:
                return int(value)
        raise Unavailable(name, "model", f"the {config.model_type} config states none of {', '.join(attributes)}")

    @property
    def num_layers(self) -> int:
        """The number of decoder blocks, len(model.layers)."""
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream."""
        return self._size("hidden_size", "hidden_size", "n_embd", "d_model")

    @property
    def num_heads(self) -> int:
        """Query heads per attention block."""
        return self._size("num_heads", "num_attention_heads", "n_head")

    @property
    def num_kv_heads(self) -> int:
        """Key and value heads per attention block (fewer than num_heads under grouped-query attention)."""
        try:
            return self._size("num_kv_heads", "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
        except Unavailable:
            if self.reason("num_kv_heads") is not None:
                raise
            return self.num_heads

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        try:
            return self._size("head_dim", "head_dim")
        except Unavailable:
            if self.reason("head_dim") is not None:
                raise
            return self.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        """The number of logits per position."""
        return self._size("vocab_size", "vocab_size")

    def trace(self, *inputs: Any, prepend_bos: Optional[bool] = None, attention_mask: Any = None,
              **kwargs: Any) -> Any:
        """Run the model on `inputs` and serve its values under streamscope's names inside the ``with`` block.

            with model.trace("The Eiffel Tower is in"):
                mid = model.layers[1].layer_mid.save()           # read: a private copy, [batch, seq, hidden_size]
                model.layers[1].layer_output[:, -1] += vector    # edit in place: reaches the model
                model.layers[2].skip(model.layers[2].layer_input)
                logits = model.logits.save()

        `inputs` is a prompt (text, or token ids: a list of ints, a ``[seq]`` or ``[1, seq]`` tensor) or
        several (a list of strings, a list of id lists, a ``[batch, seq]`` tensor with `attention_mask`, or a
        tokenizer's output); with none, add prompts with ``tracer.invoke(prompt)`` inside. Text is tokenized
        by the tokenizer's own rule for BOS, as ``tokenizer(text)``, vLLM and the server do; `prepend_bos`
        True puts one BOS first whatever the tokenizer does (TransformerLens's default), False leaves it out.
        On transformers several prompts run as one batch padded on the left, with position ids counted from
        each prompt's first token: every real position's value is the prompt's alone, and position -1 is
        every prompt's last token. A vLLM request is one prompt, unpadded: several run the body once per
        prompt, an invoke (a request) each, and a saved name comes back as a list, one value per prompt. Read
        values in the order the model computes
        them (`model.support()` lists them). On vLLM pass sampling settings
        (``model.trace(prompt, temperature=0.0, max_tokens=1)``); ``tracer.iter[:]`` steps through the
        generated tokens, and each invoke's values are ``[1, tokens, hidden_size]``.
        """
        if "fn" not in kwargs and len(inputs) == 1:  # a trace proper (generate passes its own fn)
            prompts = trace_prompts(self.tokenizer, inputs[0], attention_mask, prepend_bos)
            if prompts is not None:
                inputs, attention_mask, prepend_bos = (self.engine.trace_input(prompts),), None, None
        if prepend_bos is not None:
            raise ValueError(f"prepend_bos={prepend_bos!r} applies to a trace's text prompts; this input has none")
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return super().trace(*inputs, **kwargs)  # type: ignore[misc]

    def cache(self, prompts: Any, values: Any = None, layers: Any = None, **kwargs: Any) -> Any:
        """Run `prompts` (a string or a list) and keep `values` of `layers` in a `streamscope.Cache`.

        Default: what TransformerLens's run_with_cache keeps, every served
        boundary, contribution and neuron value of every block, attention's
        queries, keys, values, per-head outputs, scores and pattern, the root
        values and the logits (``values="all"``: everything served; the memory
        is in `streamscope.workflows.cache.build_cache`'s docstring). The cache answers streamscope's names and
        TransformerLens's hook names; see `streamscope.cache`. Several prompts
        are padded on the left (``padding_side="right"`` for the other side):
        ``[:, -1]`` is every prompt's last token, `Cache.mask` says which
        positions are real. Text is tokenized by the tokenizer's own BOS rule
        (``prepend_bos=True`` for TransformerLens's). Keyword arguments:
        ``logits``, ``batch_size``, ``progress``, ``prepend_bos``,
        ``padding_side``, ``names_filter``, ``pos_slice``, ``remove_batch_dim``
        (TransformerLens's ``run_with_cache`` arguments, with its meaning).
        """
        return build_cache(self, prompts, values, layers, **kwargs)

    def run_with_cache(self, input: Any, return_type: Optional[str] = "logits", **kwargs: Any) -> tuple[Any, Any]:
        """``(output, cache)`` of one run, as TransformerLens 4.3's ``run_with_cache``.

        `output` is ``[batch, seq, vocab_size]`` logits (several prompts padded on the left with zeros), or with
        `return_type` ``"loss"`` TL's mean next-token cross entropy over real tokens, ``"both"`` ``(logits,
        loss)``, None nothing; ``loss_per_token=True`` gives ``[batch, seq - 1]``. `cache` is `model.cache`'s
        `streamscope.Cache` (keyword arguments as there, ``pos_slice`` and ``remove_batch_dim`` applied to the
        cache only). See `streamscope.workflows.runs.run_with_cache`."""
        return run_with_cache(self, input, return_type=return_type, **kwargs)

    def run_with_hooks(self, input: Any, fwd_hooks: Any = (), return_type: Optional[str] = "logits",
                       loss_per_token: bool = False, **kwargs: Any) -> Any:
        """Run `input` with hook functions on named values, as TransformerLens 4.3's ``run_with_hooks``.

        ``fwd_hooks=[(name or filter, hook_fn), ...]``, a name a TransformerLens hook name
        (``blocks.3.hook_resid_pre``) or a streamscope name (``layers.3.layer_input``); ``hook_fn(value, hook)``
        runs where the model computes the value, and a tensor it returns (or an in-place edit) reaches the model.
        Returns logits ``[batch, seq, vocab_size]`` (padded on the left with zeros), TL's loss (``"loss"``,
        ``loss_per_token``), both, or None. See `streamscope.workflows.runs.run_with_hooks`."""
        return run_with_hooks(self, input, fwd_hooks, return_type=return_type, loss_per_token=loss_per_token,
                              **kwargs)

    def norms(self, prompts: Any = None, value: str = "layer_output", layers: Any = None) -> Any:
        """``||h||`` per block, ``[blocks]`` float32: `value`'s mean row norm over the prompts' positions after the
        first (None: streamscope's calibration text, the norms a steer's dose is measured against). See
        `streamscope.bulk.norms.norms`."""
        return norms(self, prompts, value, layers)

    def statistics(self, prompts: Any, labels: Any, value: str = "layer_output", layers: Any = None,
                   positions: Any = "last", **options: Any) -> Any:
        """Running moments of `value` per label over many prompts (count, sum, optional second moment): a
        `streamscope.bulk.moments.Moments`, which `streamscope.directions.from_moments` fits directions from.
        Options: ``reduce`` ("mean"), ``second``, ``pairs``, ``chunk_size``, ``progress`` and `model.harvest`'s;
        see `streamscope.bulk.moments.statistics`."""
        return statistics(self, prompts, labels, value, layers, positions, **options)

    # TransformerLens 4.3's token helpers (streamscope.workflows.tl), with the tokenizer's own BOS rule by default.

    def to_tokens(self, input: Any, prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None) -> Any:
        """``[batch, pos]`` token ids of a string or strings, as TransformerLens 4.3's ``to_tokens``.

        By default the tokenizer's own rule for BOS (the tokens `model.cache`, a trace, vLLM and the server run);
        ``prepend_bos=True`` puts one BOS first whether or not the tokenizer adds it (TransformerLens's default),
        False leaves it out. Several strings are padded on the left, or on ``padding_side="right"``."""
        return to_tokens(self.tokenizer, input, prepend_bos, padding_side, self.config.model_type)

    def to_str_tokens(self, input: Any, prepend_bos: Optional[bool] = None,
                      padding_side: Optional[str] = None) -> Any:
        """Each token of a string, strings or token ids as its string, as TransformerLens 4.3's ``to_str_tokens``
        (text tokenized as `to_tokens`: the tokenizer's own BOS rule unless `prepend_bos` says otherwise)."""
        return to_str_tokens(self.tokenizer, input, prepend_bos, padding_side, self.config.model_type)

    def to_single_token(self, string: str) -> int:
        """The one token id of `string`, no BOS (TransformerLens 4.3's ``to_single_token``); several are refused."""
        return to_single_token(self.tokenizer, string)

    def to_string(self, tokens: Any) -> Any:
        """Token ids back to text: ``[pos]`` to a string, ``[batch, pos]`` to a list (TL's ``to_string``)."""
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2:
            return self.tokenizer.batch_decode(ids, clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids.reshape(-1), clean_up_tokenization_spaces=False)

    def support(self) -> ModelSupport:
        """Every value of every block, served or why not, computed without running the model."""
        root = BlockSupport("model", {**self.value_reasons(), "logits": None})
        blocks = [layer.support() for layer in self.layers]
        name = f"{self.config.model_type} ({len(blocks)} blocks, {self.engine.name})"
        return ModelSupport(name, root, blocks)


def _config(path: Any, settings: dict[str, Any]) -> Any:
    """The config of the model at `path`: a model built in memory's own, the caller's ``config=``, or the checkpoint's."""
    if isinstance(path, torch.nn.Module):
        return path.config
    if settings.get("config") is not None:
        return settings["config"]

    return AutoConfig.from_pretrained(str(path), trust_remote_code=settings.get("trust_remote_code", False))
