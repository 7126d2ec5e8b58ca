"""GGUF round trips of LlamaWeights, determinism, the tokenizer stub, and every read error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from shardkit.engines import gguf_io
from shardkit.engines.gguf_io import (
    llama_tensors,
    read_llama_gguf,
    write_llama_gguf,
    write_tiny_llama_gguf,
)
from shardkit.engines.llama_weights import LlamaConfig, LlamaWeights, random_weights
from shardkit.errors import GgufFormatError, GgufUnavailableError, ShardkitError

#: Small enough to keep every test fast; grouped-query attention and a vocab with special tokens.
SMALL = LlamaConfig(vocab_size=300, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ff_size=64)


@pytest.fixture
def gguf() -> ModuleType:
    module: ModuleType = pytest.importorskip("gguf")
    return module


def assert_same_weights(found: LlamaWeights, expected: LlamaWeights) -> None:
    assert found.config == expected.config
    assert found.name == expected.name
    found_arrays, expected_arrays = llama_tensors(found), llama_tensors(expected)
    assert list(found_arrays) == list(expected_arrays)
    for name, array in expected_arrays.items():
        assert found_arrays[name].dtype == np.float32, name
        assert np.array_equal(found_arrays[name], array), name


def write_edited(path: Path, weights: LlamaWeights, edit: Callable[[Any], None]) -> Path:
    """Write ``weights`` as write_llama_gguf would, after ``edit(writer)`` changed keys or tensors."""
    writer = gguf_io._llama_writer(path, weights, tensor_type="F32")
    edit(writer)
    gguf_io._finish(writer)
    return path


def value(reader: Any, key: str) -> Any:
    """A metadata value: a scalar, a string, or a list (ReaderField.contents() is newer than gguf 0.10)."""
    field = reader.fields[key]
    strings = field.types[-1].name == "STRING"
    items = [bytes(field.parts[index]).decode() if strings else field.parts[index].tolist()[0] for index in field.data]
    return items if field.types[0].name == "ARRAY" else items[0]


def read_error(path: Path) -> str:
    with pytest.raises(GgufFormatError) as caught:
        read_llama_gguf(path)
    message = str(caught.value)
    assert str(path) in message
    return message


# --------------------------------------------------------------------------- round trips


@pytest.mark.usefixtures("gguf")
@pytest.mark.parametrize("config", [LlamaConfig(), SMALL], ids=["default", "gqa-vocab300"])
def test_f32_round_trip_is_exact(tmp_path: Path, config: LlamaConfig) -> None:
    weights = replace(random_weights(config, seed=7), name="round-trip")
    path = write_llama_gguf(tmp_path / "model.gguf", weights)
    assert path == tmp_path / "model.gguf"
    assert_same_weights(read_llama_gguf(path), weights)


@pytest.mark.usefixtures("gguf")
def test_f16_round_trip_rounds_matrices_and_keeps_norms(tmp_path: Path) -> None:
    weights = random_weights(SMALL, seed=3)
    found = read_llama_gguf(write_llama_gguf(tmp_path / "model.gguf", weights, tensor_type="F16"))
    assert found.config == weights.config
    found_arrays = llama_tensors(found)
    for name, array in llama_tensors(weights).items():
        assert found_arrays[name].dtype == np.float32
        expected = array if array.ndim == 1 else array.astype(np.float16).astype(np.float32)
        assert np.array_equal(found_arrays[name], expected), name
    assert not np.array_equal(found.token_embd, weights.token_embd)  # really rounded


@pytest.mark.usefixtures("gguf")
def test_tiny_gguf_is_random_weights(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", SMALL, seed=5)
    assert_same_weights(read_llama_gguf(path), random_weights(SMALL, seed=5))


@pytest.mark.usefixtures("gguf")
@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
def test_same_arguments_give_identical_bytes(tmp_path: Path, tensor_type: Any) -> None:
    first = write_tiny_llama_gguf(tmp_path / "a.gguf", seed=1, tensor_type=tensor_type).read_bytes()
    second = write_tiny_llama_gguf(tmp_path / "b.gguf", seed=1, tensor_type=tensor_type).read_bytes()
    other_seed = write_tiny_llama_gguf(tmp_path / "c.gguf", seed=2, tensor_type=tensor_type).read_bytes()
    assert first == second
    assert first != other_seed
    assert sorted(item.name for item in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temporaries


@pytest.mark.usefixtures("gguf")
def test_write_replaces_an_existing_file_and_cleans_up_on_error(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "model.gguf"
    write_tiny_llama_gguf(path, SMALL, seed=1)
    write_tiny_llama_gguf(path, SMALL, seed=2)
    assert_same_weights(read_llama_gguf(path), random_weights(SMALL, seed=2))
    broken = replace(random_weights(SMALL), output=np.zeros((3, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"'output\.weight' has shape \(3, 3\), expected \(300, 32\)"):
        write_llama_gguf(path, broken)
    with pytest.raises(ValueError, match="tensor_type"):
        write_llama_gguf(path, random_weights(SMALL), tensor_type="Q8_0")  # type: ignore[arg-type]
    assert [item.name for item in path.parent.iterdir()] == ["model.gguf"]
    assert_same_weights(read_llama_gguf(path), random_weights(SMALL, seed=2))


# --------------------------------------------------------------------------- what llama.cpp reads


def test_metadata_and_layout_follow_llama_cpp(tmp_path: Path, gguf: ModuleType) -> None:
    path = write_tiny_llama_gguf(tmp_path / "model.gguf", SMALL, tensor_type="F16")
    reader = gguf.GGUFReader(path)
    fields = {key: value(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
    expected = {
        "general.architecture": "llama",
        "general.name": "shardkit-tiny-llama",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "llama.context_length": SMALL.context_length,
        "llama.embedding_length": SMALL.hidden_size,
        "llama.block_count": SMALL.n_layers,
        "llama.feed_forward_length": SMALL.ff_size,
        "llama.attention.head_count": SMALL.n_heads,
        "llama.attention.head_count_kv": SMALL.n_kv_heads,
        "llama.rope.dimension_count": SMALL.head_dim,
        "llama.vocab_size": SMALL.vocab_size,
    }
    assert {key: fields[key] for key in expected} == expected
    assert fields["llama.rope.freq_base"] == pytest.approx(SMALL.rope_theta)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(SMALL.rms_eps)
    assert reader.fields["llama.attention.layer_norm_rms_epsilon"].types == [gguf.GGUFValueType.FLOAT32]

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert list(tensors) == list(gguf_io.llama_tensor_shapes(SMALL))
    # GGUF dims are innermost first: llama.cpp's {n_embd, n_vocab}, {n_embd, n_embd_k_gqa}, {n_ff, n_embd}.
    assert tensors["token_embd.weight"].shape.tolist() == [SMALL.hidden_size, SMALL.vocab_size]
    assert tensors["blk.0.attn_k.weight"].shape.tolist() == [SMALL.hidden_size, SMALL.kv_dim]
    assert tensors["blk.1.ffn_down.weight"].shape.tolist() == [SMALL.ff_size, SMALL.hidden_size]
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert reader.data_offset % reader.alignment == 0
    assert all(tensor.data_offset % reader.alignment == 0 for tensor in reader.tensors)


def test_tokenizer_with_special_tokens(tmp_path: Path, gguf: ModuleType) -> None:
    reader = gguf.GGUFReader(write_tiny_llama_gguf(tmp_path / "model.gguf", SMALL))
    assert value(reader, "tokenizer.ggml.model") == "llama"
    tokens = value(reader, "tokenizer.ggml.tokens")
    types = value(reader, "tokenizer.ggml.token_type")
    scores = value(reader, "tokenizer.ggml.scores")
    assert len(tokens) == len(types) == len(scores) == SMALL.vocab_size
    assert len(set(tokens)) == len(tokens)  # llama.cpp maps text -> id
    kind = gguf.TokenType
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert types[:3] == [kind.UNKNOWN, kind.CONTROL, kind.CONTROL]
    assert tokens[3 + 0x0A] == "<0x0A>"
    assert tokens[258] == "<0xFF>"
    assert set(types[3:259]) == {kind.BYTE}
    assert tokens[259:] == [f"tok{index}" for index in range(259, SMALL.vocab_size)]
    assert set(types[259:]) == {kind.NORMAL}
    assert set(scores) == {0.0}
    ids = {key: value(reader, f"tokenizer.ggml.{key}") for key in ("bos_token_id", "eos_token_id")}
    assert ids == {"bos_token_id": 1, "eos_token_id": 2}
    assert value(reader, "tokenizer.ggml.unknown_token_id") == 0


@pytest.mark.parametrize("vocab_size", [256, 258, 40])
def test_tokenizer_of_a_small_vocab_is_bytes_then_filler(tmp_path: Path, gguf: ModuleType, vocab_size: int) -> None:
    config = replace(SMALL, vocab_size=vocab_size)
    reader = gguf.GGUFReader(write_tiny_llama_gguf(tmp_path / "model.gguf", config))
    assert value(reader, "tokenizer.ggml.model") == "llama"
    tokens = value(reader, "tokenizer.ggml.tokens")
    types = value(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == vocab_size
    byte_count = min(vocab_size, 256)
    assert tokens[:byte_count] == [f"<0x{value:02X}>" for value in range(byte_count)]
    assert types == [gguf.TokenType.BYTE] * byte_count + [gguf.TokenType.NORMAL] * (vocab_size - byte_count)
    assert tokens[byte_count:] == [f"tok{index}" for index in range(byte_count, vocab_size)]
    assert value(reader, "tokenizer.ggml.bos_token_id") == 0
    assert value(reader, "tokenizer.ggml.eos_token_id") == 0


# --------------------------------------------------------------------------- what a reader tolerates


def test_vocab_size_falls_back_to_the_embedding_shape(tmp_path: Path, gguf: ModuleType) -> None:
    weights = random_weights(SMALL)
    path = write_edited(tmp_path / "model.gguf", weights, lambda writer: writer.kv_data[0].pop("llama.vocab_size"))
    assert gguf.GGUFReader(path).get_field("llama.vocab_size") is None
    assert_same_weights(read_llama_gguf(path), weights)


@pytest.mark.usefixtures("gguf")
def test_tied_embeddings_use_token_embd_as_output(tmp_path: Path) -> None:
    weights = random_weights(SMALL)
    path = write_edited(tmp_path / "model.gguf", weights, lambda writer: writer.tensors[0].pop("output.weight"))
    found = read_llama_gguf(path)
    assert np.array_equal(found.output, weights.token_embd)
    assert np.array_equal(found.token_embd, weights.token_embd)


# --------------------------------------------------------------------------- errors


@pytest.mark.usefixtures("gguf")
def test_missing_file(tmp_path: Path) -> None:
    assert "does not exist" in read_error(tmp_path / "absent.gguf")


@pytest.mark.usefixtures("gguf")
def test_a_directory(tmp_path: Path) -> None:
    assert "not a regular file" in read_error(tmp_path)


@pytest.mark.usefixtures("gguf")
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "is not a GGUF file (it is empty)"),
        (b"GG", "is not a GGUF file (it starts with b'GG', not b'GGUF')"),
        (b'{"format": "shardkit-trace"}\n', "is not a GGUF file (it starts with b'{\"fo', not b'GGUF')"),
    ],
    ids=["empty", "two-bytes", "json"],
)
def test_not_a_gguf_file(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert expected in read_error(path)


@pytest.mark.usefixtures("gguf")
@pytest.mark.parametrize("size", [4, 24, 200, 5000, -100])
def test_truncated_gguf(tmp_path: Path, size: int) -> None:
    good = write_tiny_llama_gguf(tmp_path / "good.gguf", SMALL).read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(good[:size])
    assert "is truncated or corrupt" in read_error(path)


def test_another_architecture(tmp_path: Path, gguf: ModuleType) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    gguf_io._finish(writer)
    message = read_error(path)
    assert "general.architecture is 'gpt2'" in message
    assert "only 'llama'" in message


def test_quantized_tensor(tmp_path: Path, gguf: ModuleType) -> None:
    weights = random_weights(SMALL)
    name = "blk.1.attn_v.weight"
    q8 = gguf.GGMLQuantizationType.Q8_0

    def quantize(writer: Any) -> None:
        del writer.tensors[0][name]
        writer.add_tensor(name, gguf.quants.quantize(weights.layers[1].attn_v, q8), raw_dtype=q8)

    path = write_edited(tmp_path / "model.gguf", weights, quantize)
    assert gguf.GGUFReader(path).tensors[-1].tensor_type == q8
    message = read_error(path)
    assert f"tensor {name!r} has type Q8_0" in message
    assert "only F32 and F16" in message


@pytest.mark.usefixtures("gguf")
def test_missing_tensor(tmp_path: Path) -> None:
    path = write_edited(
        tmp_path / "model.gguf", random_weights(SMALL), lambda writer: writer.tensors[0].pop("blk.0.ffn_up.weight")
    )
    assert "tensor 'blk.0.ffn_up.weight' is missing" in read_error(path)


@pytest.mark.usefixtures("gguf")
def test_wrong_shape(tmp_path: Path) -> None:
    weights = random_weights(SMALL)
    name = "blk.1.ffn_gate.weight"

    def transpose(writer: Any) -> None:
        del writer.tensors[0][name]
        writer.add_tensor(name, np.ascontiguousarray(weights.layers[1].ffn_gate.T))

    message = read_error(write_edited(tmp_path / "model.gguf", weights, transpose))
    assert f"tensor {name!r} has shape (32, 64), expected (64, 32)" in message


@pytest.mark.usefixtures("gguf")
def test_unexpected_tensor(tmp_path: Path) -> None:
    def add_bias(writer: Any) -> None:
        writer.add_tensor("blk.0.attn_q.bias", np.zeros(SMALL.hidden_size, dtype=np.float32))

    message = read_error(write_edited(tmp_path / "model.gguf", random_weights(SMALL), add_bias))
    assert "tensor 'blk.0.attn_q.bias' is not part of the plain llama layout" in message


@pytest.mark.usefixtures("gguf")
@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.layer_norm_rms_epsilon", "general.architecture"])
def test_missing_metadata_key(tmp_path: Path, key: str) -> None:
    path = write_edited(tmp_path / "model.gguf", random_weights(SMALL), lambda writer: writer.kv_data[0].pop(key))
    assert f"metadata key {key!r} is missing" in read_error(path)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("llama.block_count", "four", "'llama.block_count' should be an integer, found type STRING"),
        ("llama.rope.dimension_count", 4, "'llama.rope.dimension_count' is 4, expected the head size 8"),
        ("llama.attention.head_count", 3, "does not describe a valid llama config"),
        ("llama.expert_count", 8, "mixture-of-experts"),
    ],
)
def test_bad_metadata_value(tmp_path: Path, gguf: ModuleType, key: str, value: object, expected: str) -> None:
    kind = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32

    def edit(writer: Any) -> None:
        writer.kv_data[0].pop(key, None)  # older gguf versions refuse to overwrite a key
        writer.add_key_value(key, value, kind)

    assert expected in read_error(write_edited(tmp_path / "model.gguf", random_weights(SMALL), edit))


# --------------------------------------------------------------------------- without the gguf package


def test_without_the_gguf_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(GgufUnavailableError) as caught:
        read_llama_gguf(tmp_path / "model.gguf")
    assert str(caught.value) == "reading GGUF files needs the gguf package: pip install 'shardkit[gguf]'"
    assert isinstance(caught.value, ImportError)
    assert isinstance(caught.value, ShardkitError)
    with pytest.raises(GgufUnavailableError, match=r"writing GGUF files needs the gguf package: .*shardkit\[gguf\]"):
        write_tiny_llama_gguf(tmp_path / "model.gguf")
    assert list(tmp_path.iterdir()) == []


def test_importing_shardkit_does_not_import_gguf() -> None:
    code = "import sys, shardkit, shardkit.engines.gguf_io; assert 'gguf' not in sys.modules, 'gguf imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)
