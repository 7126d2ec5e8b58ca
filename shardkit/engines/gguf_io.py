"""Read and write llama-architecture GGUF files holding :class:`LlamaWeights`.

The files are what llama.cpp loads: the ``llama`` metadata keys, the usual
tensor names (``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...), and a
minimal SentencePiece-style byte vocabulary so the file loads without ever
tokenizing text. A matrix held as a numpy ``(out, in)`` array is stored as is:
GGUF lists dimensions innermost first, so its GGUF dims read ``[in, out]``,
which is exactly llama.cpp's ``{n_embd, n_out}``. Q and K are not permuted —
:mod:`shardkit.engines.llama_weights` already uses llama.cpp's rotary layout.

The ``gguf`` package is an optional extra (``pip install 'shardkit[gguf]'``)
and is imported only when a function here runs, so ``import shardkit`` works
without it.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from shardkit.engines.llama_weights import LAYER_TENSORS, LlamaConfig, LlamaLayer, LlamaWeights, Matrix, random_weights
from shardkit.errors import GgufFormatError, GgufUnavailableError

if TYPE_CHECKING:
    import gguf

__all__ = [
    "GgufFormatError",
    "GgufUnavailableError",
    "llama_tensor_shapes",
    "llama_tensors",
    "read_llama_gguf",
    "write_llama_gguf",
    "write_tiny_llama_gguf",
]

ARCHITECTURE = "llama"
_INSTALL_HINT = "pip install 'shardkit[gguf]'"


def _require_gguf(action: str) -> None:
    """Import ``gguf`` or raise :class:`GgufUnavailableError` naming the extra to install.
    Callers then ``import gguf`` themselves, so mypy sees the package's own type hints."""
    try:
        importlib.import_module("gguf")
    except ImportError as error:
        message = f"{action} GGUF files needs the gguf package: {_INSTALL_HINT}"
        raise GgufUnavailableError(message) from error


# --------------------------------------------------------------------------- layout


def llama_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama GGUF, in file order, with its numpy shape ``(out, in)``."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, config.hidden_size)}
    layer_shapes = config.layer_shapes()
    for index in range(config.n_layers):
        for name in LAYER_TENSORS:
            shapes[f"blk.{index}.{name}.weight"] = layer_shapes[name]
    shapes["output_norm.weight"] = (config.hidden_size,)
    shapes["output.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def llama_tensors(weights: LlamaWeights) -> dict[str, Matrix]:
    """The arrays of ``weights`` under their GGUF names, in file order, checked against the config."""
    config = weights.config
    if len(weights.layers) != config.n_layers:
        message = f"LlamaWeights has {len(weights.layers)} layers but its config says n_layers={config.n_layers}"
        raise ValueError(message)
    arrays: dict[str, Matrix] = {"token_embd.weight": weights.token_embd}
    for index, layer in enumerate(weights.layers):
        for name in LAYER_TENSORS:
            arrays[f"blk.{index}.{name}.weight"] = getattr(layer, name)
    arrays["output_norm.weight"] = weights.output_norm
    arrays["output.weight"] = weights.output
    for name, shape in llama_tensor_shapes(config).items():
        found = np.shape(arrays[name])
        if found != shape:
            message = f"LlamaWeights tensor {name!r} has shape {found}, expected {shape} for {config}"
            raise ValueError(message)
    return arrays


def _vocabulary(vocab_size: int) -> tuple[list[str], list[int], dict[str, int]]:
    """A byte-level SentencePiece ("llama") vocabulary of exactly ``vocab_size`` tokens:
    token texts, token types, and the special-token ids to record."""
    import gguf

    normal, unknown, control, byte = (
        int(kind)
        for kind in (gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.BYTE)
    )
    tokens: list[str] = []
    types: list[int] = []
    if vocab_size >= 259:
        tokens += ["<unk>", "<s>", "</s>"]
        types += [unknown, control, control]
        special = {"unk": 0, "bos": 1, "eos": 2}
    else:
        special = {"bos": 0, "eos": 0}
    byte_count = min(256, vocab_size - len(tokens))
    tokens += [f"<0x{value:02X}>" for value in range(byte_count)]
    types += [byte] * byte_count
    tokens += [f"tok{index}" for index in range(len(tokens), vocab_size)]
    types += [normal] * (vocab_size - len(types))
    return tokens, types, special


# --------------------------------------------------------------------------- writing


def _check_tensor_type(tensor_type: str) -> None:
    if tensor_type not in ("F32", "F16"):
        message = f"tensor_type must be 'F32' or 'F16', got {tensor_type!r}"
        raise ValueError(message)


def _llama_writer(path: Path, weights: LlamaWeights, *, tensor_type: Literal["F32", "F16"]) -> gguf.GGUFWriter:
    """A GGUFWriter for ``path`` with every key and tensor added, nothing written yet
    (tests edit ``writer.kv_data`` / ``writer.tensors`` before writing)."""
    _check_tensor_type(tensor_type)
    _require_gguf("writing")
    import gguf

    arrays = llama_tensors(weights)
    config = weights.config
    writer = gguf.GGUFWriter(path, ARCHITECTURE)  # adds general.architecture
    # add_string() skips an empty value; the name is always written so it reads back as given.
    writer.add_key_value(gguf.Keys.General.NAME, weights.name, gguf.GGUFValueType.STRING)
    file_type = gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(int(file_type))
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ff_size)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)  # stored as float32, as llama.cpp requires
    writer.add_layer_norm_rms_eps(config.rms_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)

    tokens, types, special = _vocabulary(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    if "unk" in special:
        writer.add_unk_token_id(special["unk"])

    for name, array in arrays.items():
        data = np.ascontiguousarray(array, dtype=np.float32)
        # Like llama.cpp's converter, F16 files keep 1-D (norm) tensors in F32.
        if tensor_type == "F16" and data.ndim > 1:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, data)
    return writer


def _finish(writer: gguf.GGUFWriter) -> None:
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def write_llama_gguf(
    path: str | os.PathLike[str], weights: LlamaWeights, *, tensor_type: Literal["F32", "F16"] = "F32"
) -> Path:
    """Write ``weights`` as a llama GGUF at ``path`` (atomically) and return the path.

    With ``tensor_type="F16"`` the matrices are rounded to float16; norm vectors stay F32.
    The same weights give a byte-identical file."""
    _check_tensor_type(tensor_type)
    _require_gguf("writing")
    llama_tensors(weights)  # shapes checked before any file is created
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)  # GGUFWriter opens the file itself
    temporary = Path(temporary_name)
    try:
        _finish(_llama_writer(temporary, weights, tensor_type=tensor_type))
        temporary.chmod(0o644)  # mkstemp creates 0600; a model file is meant to be shared
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_tiny_llama_gguf(
    path: str | os.PathLike[str],
    config: LlamaConfig | None = None,
    seed: int = 0,
    *,
    tensor_type: Literal["F32", "F16"] = "F32",
) -> Path:
    """:func:`random_weights` written as a GGUF: the same arguments give the same bytes."""
    return write_llama_gguf(path, random_weights(config, seed), tensor_type=tensor_type)


# --------------------------------------------------------------------------- reading


def _field(reader: gguf.GGUFReader, path: Path, key: str, expected: tuple[gguf.GGUFValueType, ...], what: str) -> Any:
    """The scalar value of ``key``, or None if absent; a GgufFormatError if of another type."""
    import gguf

    field = reader.get_field(key)
    if field is None:
        return None
    if len(field.types) != 1 or field.types[0] not in expected:
        found = "/".join(kind.name for kind in field.types) or "unknown"
        message = f"GGUF file {path}: metadata key {key!r} should be {what}, found type {found}"
        raise GgufFormatError(message)
    # field.parts[field.data[0]] holds the value (ReaderField.contents() is newer than gguf 0.10).
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def _require(value: Any, path: Path, key: str) -> Any:
    if value is None:
        message = f"GGUF file {path}: metadata key {key!r} is missing"
        raise GgufFormatError(message)
    return value


class _Metadata:
    """Typed access to a reader's scalar keys; every error names the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        import gguf

        kinds = gguf.GGUFValueType
        self._ints = (
            kinds.UINT8,
            kinds.INT8,
            kinds.UINT16,
            kinds.INT16,
            kinds.UINT32,
            kinds.INT32,
            kinds.UINT64,
            kinds.INT64,
        )
        self._float32 = kinds.FLOAT32
        self._floats = (kinds.FLOAT32, kinds.FLOAT64)
        self._strings = (kinds.STRING,)
        self._reader = reader
        self._path = path

    def optional_int(self, key: str) -> int | None:
        value = _field(self._reader, self._path, key, self._ints, "an integer")
        return None if value is None else int(value)

    def require_int(self, key: str, default: int | None = None) -> int:
        value = self.optional_int(key)
        return int(_require(default if value is None else value, self._path, key))

    def require_float(self, key: str, default: float | None = None) -> float:
        value = _field(self._reader, self._path, key, self._floats, "a float")
        if value is None:
            return float(_require(default, self._path, key))
        field = self._reader.get_field(key)
        if field is not None and field.types[0] == self._float32:
            # The shortest decimal that round-trips through float32, so 1e-5 reads back as 1e-5.
            return float(str(np.float32(value)))
        return float(value)

    def optional_str(self, key: str) -> str | None:
        value = _field(self._reader, self._path, key, self._strings, "a string")
        return None if value is None else str(value)


def _open(path: Path) -> gguf.GGUFReader:
    import gguf

    if not path.exists():
        message = f"GGUF file {path} does not exist"
        raise GgufFormatError(message)
    if not path.is_file():
        message = f"GGUF file {path} is not a regular file"
        raise GgufFormatError(message)
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        message = f"GGUF file {path} cannot be read: {error}"
        raise GgufFormatError(message) from error
    if magic != b"GGUF":
        found = "it is empty" if not magic else f"it starts with {magic!r}, not b'GGUF'"
        message = f"{path} is not a GGUF file ({found})"
        raise GgufFormatError(message)
    try:
        reader = gguf.GGUFReader(path, "r")
    except OSError as error:
        message = f"GGUF file {path} cannot be read: {error}"
        raise GgufFormatError(message) from error
    except (ValueError, KeyError, IndexError, OverflowError) as error:  # what GGUFReader raises on bad bytes
        message = f"GGUF file {path} is truncated or corrupt: {type(error).__name__}: {error}"
        raise GgufFormatError(message) from error
    return reader


def _config(meta: _Metadata, path: Path, tensors: Mapping[str, gguf.ReaderTensor]) -> LlamaConfig:
    arch = ARCHITECTURE
    experts = meta.optional_int(f"{arch}.expert_count")
    if experts:
        message = f"GGUF file {path}: metadata key '{arch}.expert_count' is {experts}; mixture-of-experts models are not supported"
        raise GgufFormatError(message)
    scaling = meta.optional_str(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        message = f"GGUF file {path}: metadata key '{arch}.rope.scaling.type' is {scaling!r}; only unscaled rotary embeddings are supported"
        raise GgufFormatError(message)

    vocab_size = meta.optional_int(f"{arch}.vocab_size")
    if vocab_size is None:
        token_embd = tensors.get("token_embd.weight")
        if token_embd is None:
            message = (
                f"GGUF file {path}: tensor 'token_embd.weight' is missing (and so is metadata key '{arch}.vocab_size')"
            )
            raise GgufFormatError(message)
        vocab_size = int(token_embd.shape[-1])  # GGUF dims are [hidden, vocab]
    head_count = meta.require_int(f"{arch}.attention.head_count")
    try:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=meta.require_int(f"{arch}.embedding_length"),
            n_layers=meta.require_int(f"{arch}.block_count"),
            n_heads=head_count,
            # llama.cpp's defaults for the two keys it treats as optional:
            n_kv_heads=meta.require_int(f"{arch}.attention.head_count_kv", head_count),
            rope_theta=meta.require_float(f"{arch}.rope.freq_base", 10000.0),
            ff_size=meta.require_int(f"{arch}.feed_forward_length"),
            rms_eps=meta.require_float(f"{arch}.attention.layer_norm_rms_epsilon"),
            context_length=meta.require_int(f"{arch}.context_length"),
        )
    except GgufFormatError:
        raise
    except ValueError as error:  # LlamaConfig.__post_init__
        message = f"GGUF file {path}: the metadata does not describe a valid llama config: {error}"
        raise GgufFormatError(message) from error
    for key in (f"{arch}.rope.dimension_count", f"{arch}.attention.key_length", f"{arch}.attention.value_length"):
        value = meta.optional_int(key)
        if value is not None and value != config.head_dim:
            message = f"GGUF file {path}: metadata key {key!r} is {value}, expected the head size {config.head_dim}"
            raise GgufFormatError(message)
    return config


def _tensor(path: Path, tensors: Mapping[str, gguf.ReaderTensor], name: str, shape: tuple[int, ...]) -> Matrix:
    import gguf

    tensor = tensors.get(name)
    if tensor is None:
        message = f"GGUF file {path}: tensor {name!r} is missing"
        raise GgufFormatError(message)
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        message = (
            f"GGUF file {path}: tensor {name!r} has type {kind.name}; only F32 and F16 tensors are supported "
            "(re-convert the model unquantized)"
        )
        raise GgufFormatError(message)
    # GGUF lists dims innermost first; numpy's shape is the reverse. ggml drops trailing 1 dims.
    found = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    padded = (1,) * (len(shape) - len(found)) + found
    if padded != shape:
        message = (
            f"GGUF file {path}: tensor {name!r} has shape {found}, expected {shape} "
            "(numpy order (out, in); GGUF dims are the reverse)"
        )
        raise GgufFormatError(message)
    # A copy in native float32 (the file may be big-endian), so nothing keeps the file mapped.
    return np.array(tensor.data, dtype=np.float32).reshape(shape)


def read_llama_gguf(path: str | os.PathLike[str]) -> LlamaWeights:
    """Load a plain llama GGUF (F32/F16 tensors) as :class:`LlamaWeights`.

    Raises :class:`GgufFormatError` naming the file and the key or tensor for a file that is
    missing, not GGUF, of another architecture, quantized, incomplete or mis-shaped, and
    :class:`GgufUnavailableError` if the ``gguf`` package is not installed."""
    path = Path(path)
    _require_gguf("reading")
    reader = _open(path)
    meta = _Metadata(reader, path)
    architecture = _require(meta.optional_str("general.architecture"), path, "general.architecture")
    if architecture != ARCHITECTURE:
        message = f"GGUF file {path}: general.architecture is {architecture!r}; only 'llama' is supported"
        raise GgufFormatError(message)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _config(meta, path, tensors)
    shapes = llama_tensor_shapes(config)
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        # Tied embeddings: llama.cpp then uses token_embd as the output projection too.
        tensors["output.weight"] = tensors["token_embd.weight"]
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        message = (
            f"GGUF file {path}: tensor {unknown[0]!r} is not part of the plain llama layout shardkit reads "
            f"({len(unknown)} such tensor(s): {', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''})"
        )
        raise GgufFormatError(message)
    arrays = {name: _tensor(path, tensors, name, shape) for name, shape in shapes.items()}
    layers = tuple(
        LlamaLayer(**{name: arrays[f"blk.{index}.{name}.weight"] for name in LAYER_TENSORS})
        for index in range(config.n_layers)
    )
    name = meta.optional_str("general.name")
    # Every array is a copy: nothing refers to the reader's memory map once this returns.
    return LlamaWeights(
        config=config,
        token_embd=arrays["token_embd.weight"],
        layers=layers,
        output_norm=arrays["output_norm.weight"],
        output=arrays["output.weight"],
        name=path.stem if name is None else name,
    )
