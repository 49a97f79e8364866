"""Model sources: shipped configs (public architecture facts, no weights), local config
files, and building a model on the meta device without touching real weights."""

from __future__ import annotations

import copy
import difflib
import json
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeGuard

import torch

from torchroof.config.errors import first_line
from torchroof.quant.recipes import quiet_imports

# The shipped configs, read as package data (a wheel, a zip or a checkout alike).
CONFIG_DIR: Traversable = resources.files("torchroof.models") / "configs"
DEFAULT_MODEL = "llama-3-8b"

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


class ModelBuildError(ValueError):
    """transformers could not build a causal LM from the config given."""


class ModelLimitError(ValueError):
    """A workload or config the model cannot run: more positions than it has, no layers."""


class PositionLimitError(ModelLimitError):
    """A sequence longer than the model's maximum number of positions."""


class LayerCountError(ModelLimitError):
    """A config with no layers (or a negative count)."""


class UnknownModelError(KeyError):
    """No shipped config of that name and no config file at that path."""

    def __str__(self) -> str:
        return str(self.args[0])


def shipped_models() -> list[str]:
    return sorted(
        entry.name.removesuffix(".json")
        for entry in CONFIG_DIR.iterdir()
        if entry.name.endswith(".json")
    )


def model_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; a clear error for anything a model cannot be cast to."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unsupported model dtype {name!r}; choose one of bf16, fp16, fp32"
        ) from None


def shipped_config_dict(name: str) -> dict[str, Any]:
    path = CONFIG_DIR / f"{name}.json"
    if name not in shipped_models():
        close = difflib.get_close_matches(name, shipped_models(), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownModelError(
            f"unknown model {name!r}{hint} (shipped: {', '.join(shipped_models())}; "
            "or pass a path to a config.json or a model directory)"
        )
    return json.loads(path.read_text())


def load_config(source: Any) -> Any:
    """A transformers ``PretrainedConfig`` from a shipped name, a config.json, a model
    directory, or a config object (returned as is). Nothing is downloaded."""
    from transformers import PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    try:
        return _read_config(source)
    except (UnknownModelError, FileNotFoundError, ModelBuildError):
        raise
    except Exception as error:  # noqa: BLE001 - a config transformers rejects: one line
        raise ModelBuildError(f"invalid model config {source}: {first_line(error)}") from error


def _read_config(source: Any) -> Any:
    from transformers import AutoConfig

    text = str(source)
    path = Path(text)
    if path.is_dir() or (path.suffix == ".json" and path.is_file()):
        folder = path if path.is_dir() else path.parent
        file = folder / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {folder}")
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise ModelBuildError(
                f"invalid model config {file}: a JSON {type(data).__name__}, not an object"
            )
        if "model_type" not in data:
            raise ModelBuildError(f'invalid model config {file}: no "model_type"')
        check_config_dict(data, str(file))  # before transformers builds anything
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if "auto_map" in data and data["model_type"] not in CONFIG_MAPPING_NAMES:
            raise ModelBuildError(
                f"invalid model config {file}: model_type {data['model_type']!r} is not one "
                "transformers knows, and its auto_map names the directory's own Python code, "
                "which torchroof never runs (trust_remote_code=False)"
            )
        if path.is_file() and path.name != "config.json":
            data.pop("auto_map", None)  # never the file's own code
            return AutoConfig.for_model(data.pop("model_type"), **data)
        # Never the directory's own code: a config whose model_type transformers does not
        # know and that names a Python file (auto_map) is refused, never run or prompted.
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    data = {k: v for k, v in shipped_config_dict(text).items() if not k.startswith("_")}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def model_class(config: Any) -> Any:
    """The transformers auto class for ``config``: sequence-to-sequence LM for an
    encoder–decoder (T5, BART), causal LM for a decoder, masked LM for an encoder that
    has no causal head (DistilBERT, DeBERTa)."""
    with quiet_imports():  # transformers' modeling imports torchao when it is installed
        import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False) and kind in (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    ):
        return AutoModelForSeq2SeqLM
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForMaskedLM


_DECODER_ONLY_AS_CAUSAL_LM = ("reformer",)


def build_model(config: Any, dtype: str | torch.dtype = "bf16") -> torch.nn.Module:
    """A language model from ``config`` on the meta device: no weights, no memory."""
    from torchroof.models.completions import causal_lm_sub_config

    dtype = model_dtype(dtype)
    auto = model_class(config)
    if getattr(config, "model_type", "") in _DECODER_ONLY_AS_CAUSAL_LM and not config.is_decoder:
        # Reformer's LM head asserts ``is_decoder=True`` (its config defaults to False):
        # a causal LM is a decoder, so the copy says so; nothing else in the config changes.
        config = copy.deepcopy(config)
        config.is_decoder = True
    try:
        with torch.device("meta"):
            built = causal_lm_sub_config(config) if auto.__name__.endswith("CausalLM") else None
            if built is not None:  # a composite whose causal LM takes a sub-config (MusicGen)
                model_cls, sub_config = built
                model = model_cls._from_config(sub_config, dtype=dtype)
            else:
                try:
                    model = auto.from_config(config, dtype=dtype, trust_remote_code=False)
                except ImportError as missing:
                    # A multimodal model whose vision or audio tower needs a package that is
                    # not installed (Gemma 3n: timm): the language model alone, from its
                    # text config, and the estimate says so.
                    text = config.get_text_config(decoder=True)
                    if text is config:
                        raise
                    model = model_class(text).from_config(
                        text, dtype=dtype, trust_remote_code=False
                    )
                    model.torchroof_build_note = (
                        f"built text-only as {type(model).__name__} (the full "
                        f"{type(config).__name__} model needs {first_line(missing)[:120]})"
                    )
    except Exception as error:  # noqa: BLE001 - every build failure is one clear line
        raise ModelBuildError(
            f"cannot build a language model from {type(config).__name__}: {first_line(error)}"
        ) from error
    _prepare(model, dtype)
    return model.eval()


def _prepare(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """What a model needs beyond its config before it can run on meta.

    Parameters made by a factory the ``torch.device("meta")`` context does not reach
    (``torch.FloatTensor(...)`` in XLNet, ``torch.normal(mean, std, size)`` in DiffLlama)
    land on the CPU, the legacy constructor's in fp32: they are moved to meta, floating
    ones in the model dtype, so no real compute or device copy sneaks into the trace.
    X-MOD routes every layer through a language adapter and refuses input without a
    language: the config's first language is taken as the default. GIT is traced text-only.
    """
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta:
                continue
            if id(param) not in moved:
                kind = dtype if param.is_floating_point() else param.dtype
                stand_in = torch.empty_like(param, device="meta", dtype=kind)
                moved[id(param)] = torch.nn.Parameter(stand_in, requires_grad=param.requires_grad)
            module._parameters[name] = moved[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="meta")
    # GIT's loss drops the logits of the image tokens it expects before the text; a
    # text-only step (no pixel_values) has none, so it would drop the text's own logits.
    git = getattr(model, "git", None)
    for layer in getattr(getattr(git, "encoder", None), "layer", []):
        self_attention: Any = getattr(getattr(layer, "attention", None), "self", None)
        if hasattr(self_attention, "image_patch_tokens"):
            self_attention.image_patch_tokens = 0
    config: Any = getattr(model, "config", None)
    languages = getattr(config, "languages", None)
    set_default_language = getattr(model, "set_default_language", None)
    if set_default_language is not None and languages and not config.default_language:
        set_default_language(list(languages)[0])


# -- limits of a config ---------------------------------------------------------------------
# The config fields that state the most positions a model takes, in the order looked for
# (the field the config itself stores is the one named: GPT-2 stores n_positions, its
# max_position_embeddings is an alias).
POSITION_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "max_seq_len",
    "max_target_positions",  # a decoder's own positions (Whisper)
    "context_length",  # RWKV: the longest sequence its kernel takes
    "model_max_length",
)
# Depth fields: every one a config stores must be at least 1.
LAYER_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "num_decoder_layers",
    "encoder_layers",
    "num_encoder_layers",
)
_ROTARY_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct")
# How a caller is told to lift the position check (estimate / trace_model keyword, CLI flag).
ALLOW_BEYOND_HINT = "allow_beyond_max_positions=True (CLI: --allow-beyond-max-positions)"


def _stored_fields(config: Any) -> dict[str, Any]:
    """The fields a config (its text decoder's, for a multimodal one) really stores;
    aliases from ``attribute_map`` are left out, so the name reported is the file's."""
    text = config
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text(decoder=True)
        except Exception:  # noqa: BLE001 - a config without one: the config itself
            text = config
    fields = dict(vars(text)) if hasattr(text, "__dict__") else {}
    if text is not config and hasattr(config, "__dict__"):
        for name, value in vars(config).items():
            fields.setdefault(name, value)
    return fields


def _is_count(value: object) -> TypeGuard[int]:
    """A whole number of something (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def text_config(config: Any) -> Any:
    """The text model's configuration of ``config`` (a multimodal one's language model),
    else ``config`` itself (transformers' ``get_text_config``)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _model_label(config: Any, name: str | None) -> str:
    if name:
        return str(name)
    path = getattr(config, "name_or_path", "") or ""
    if path:
        return str(path)
    kind = getattr(config, "model_type", "") or ""
    return f"{kind} ({type(config).__name__})" if kind else type(config).__name__


def position_limit(config: Any) -> tuple[str, int] | None:
    """``(field, value)`` of the most positions the model takes, or None when the config
    states none (relative or no position encoding: T5, Mamba)."""
    fields = _stored_fields(config)
    for field in POSITION_FIELDS:
        value = fields.get(field)
        if _is_count(value) and value > 0:
            return field, value
    return None


def check_positions(
    config: Any, length: int, allow_beyond: bool, *, name: str | None = None
) -> str | None:
    """Refuse a step whose sequence holds more positions than the model has.

    ``length`` is the positions one sequence of the step spans: ``seq`` for prefill and
    train, ``context + 1`` for decode. Within the maximum, or with no maximum stated:
    None. Beyond it: :class:`PositionLimitError`, or with ``allow_beyond`` the assumption
    line the estimate should carry. ``name`` labels the model in the messages.
    """
    limit = position_limit(config)
    if limit is None or length <= limit[1]:
        return None
    field, maximum = limit
    label = _model_label(config, name)
    if not allow_beyond:
        raise PositionLimitError(
            f"{label}: a sequence of {length:,} positions is longer than the model's "
            f"maximum, {field}={maximum:,} (from its config); use at most {maximum:,} "
            f"positions, or price it anyway with {ALLOW_BEYOND_HINT}"
        )
    return (
        f"{length:,} positions exceed {label}'s {field}={maximum:,} (allowed beyond the "
        f"maximum): {_beyond_consequence(config)}"
    )


def _beyond_consequence(config: Any) -> str:
    """What positions past the model's maximum mean: rotary ones cost the same, a learned
    position table has no row for them."""
    fields = _stored_fields(config)
    if any(fields.get(f) is not None for f in _ROTARY_FIELDS):
        return (
            "rotary positions past the trained range cost the same; the quality they give "
            "is not modelled"
        )
    return (
        "the model has no position embedding past that, so a real run fails there; "
        "priced as if the table were longer"
    )


def check_new_positions(
    config: Any, length: int, added: int, *, name: str | None = None
) -> str | None:
    """The note for a step within the maximum whose own new tokens go past it: decode at
    ``context`` equal to the maximum writes its token at position ``context``, one past the
    last the model has. Priced (the cache is the model's full window), never silently: the
    note says a real run needs ``length + added`` positions. None when there is no limit,
    the step is already beyond it (:func:`check_positions` spoke), or its tokens fit."""
    limit = position_limit(config)
    if limit is None or added <= 0 or length > limit[1] or length + added <= limit[1]:
        return None
    field, maximum = limit
    return (
        f"the step's new token sits at position {length:,}, past {_model_label(config, name)}'s "
        f"{field}={maximum:,} (positions 0 to {maximum - 1:,}): a real run needs "
        f"{length + added:,} positions; {_beyond_consequence(config)}"
    )


# Sizes every config that stores them needs at least 1 of (a vocabulary or an MLP of 0 is
# priced as a step without them, silently).
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "n_embd",
    "n_head",
    "d_model",
)
# Families whose head dimension is hidden_size / num_attention_heads unless head_dim is set.
_HEAD_DIM_FROM_HIDDEN = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gpt2",
)


def config_problems(fields: dict[str, Any], model_type: str = "") -> list[str]:
    """What makes a config unusable, from its stored fields: a size below 1, more layers
    than :data:`torchroof.config.limits.DEFAULT_MAX_LAYERS`, a hidden size that its heads do not
    divide, K/V heads that do not divide the heads."""
    from torchroof.config.limits import DEFAULT_MAX_LAYERS

    problems = []
    for name in SIZE_FIELDS + LAYER_FIELDS:
        value = fields.get(name)
        if value is None or isinstance(value, (list, tuple, dict)):  # per layer or per part
            continue
        if not _is_count(value):
            problems.append(f"{name}={value!r} is not an integer")
        elif value < 1 and name not in LAYER_FIELDS:  # no layers: check_layers says so
            problems.append(f"{name}={value} (at least 1 is needed)")
        elif name in LAYER_FIELDS and value > DEFAULT_MAX_LAYERS:
            problems.append(
                f"{name}={value:,} is above the layer budget of {DEFAULT_MAX_LAYERS:,} "
                "(torchroof.config.limits.DEFAULT_MAX_LAYERS; the deepest real model has 126)"
            )
    if problems:
        return problems
    heads = fields.get("num_attention_heads") or fields.get("n_head")
    hidden = fields.get("hidden_size") or fields.get("n_embd")
    kv = fields.get("num_key_value_heads")
    if (
        model_type in _HEAD_DIM_FROM_HIDDEN
        and fields.get("head_dim") is None
        and _is_count(heads)
        and _is_count(hidden)
        and hidden % heads
    ):
        problems.append(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "(set head_dim, or a hidden size the heads divide)"
        )
    head_dim = fields.get("head_dim")
    if model_type in _HEAD_DIM_FROM_HIDDEN and _is_count(head_dim) and head_dim < 1:
        problems.append(f"head_dim={head_dim} (at least 1 is needed)")
    if _is_count(heads) and _is_count(kv) and (kv > heads or heads % kv):
        problems.append(
            f"num_key_value_heads={kv} does not divide num_attention_heads={heads} "
            "(each K/V head serves a whole group of query heads)"
        )
    return problems


def check_config_dict(data: dict[str, Any], where: str) -> None:
    """A config file's fields checked before transformers builds a config from them."""
    problems = config_problems(data, str(data.get("model_type", "")))
    if problems:
        raise ModelBuildError(f"invalid model config {where}: " + "; ".join(problems))


def check_layers(config: Any, *, name: str | None = None) -> None:
    """Refuse a config with 0 (or fewer) layers: the step would price embeddings and head
    alone, as if they were the model; and one :func:`config_problems` finds unusable."""
    fields = _stored_fields(config)
    problems = config_problems(fields, str(getattr(config, "model_type", "") or ""))
    if problems:
        raise ModelBuildError(
            f"invalid model config {_model_label(config, name)}: " + "; ".join(problems)
        )
    for field in LAYER_FIELDS:
        value = fields.get(field)
        if _is_count(value) and value < 1:
            raise LayerCountError(
                f"{_model_label(config, name)}: {field}={value} in its config; a model needs "
                "at least 1 layer (a step without layers prices only the embedding and the "
                "head)"
            )
