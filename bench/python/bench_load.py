"""Loading a model: wall time and peak resident memory, each load in a fresh process.

    python bench/python/bench_load.py [MODEL ...] [--dtype auto] [--quantization int8|int4] [--repeats 2]

MODEL: a checkpoint directory or a GGUF file (default: the default model's Q4_1 GGUF; with
--quantization, its float checkpoint, quantized as it is read). Beside
each load: the bytes of the files, of the weights as loaded, and of the same weights in float32
(what a loader that fills float parameters before quantizing holds at its peak). Two peaks:
anonymous memory (sampled every 2 ms: what the load itself allocates) and RSS, which also counts
the pages of the files it maps (safetensors and GGUF readers map them; the kernel can drop those).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

# Runs in the child: load, then report the peak and the weights' sizes as JSON.
CHILD = r"""
import json, resource, sys, threading, time
import octavo
from octavo.layers.linear import QuantizedWeight
from octavo.loader import load_model

def kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

peak_anon, done = [anon_kib()], threading.Event()
def sample():
    while not done.wait(0.002):
        peak_anon.append(max(peak_anon[-1], anon_kib()))

anon_before, before, start = anon_kib(), kib(), time.perf_counter()
sampler = threading.Thread(target=sample)
sampler.start()
# quantization= only when asked: the loaders before it existed run this too (for a "before" row)
model = load_model(sys.argv[1], sys.argv[2], **({"quantization": sys.argv[3]} if sys.argv[3] else {}))
seconds = time.perf_counter() - start
done.set()
sampler.join()
quantized = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
params = {id(p): p for p in model.parameters()}.values()
loaded = sum(p.numel() * p.element_size() for p in params) + sum(
    sum(b.numel() * b.element_size() for b in m.buffers()) for m in quantized)
float32 = sum(p.numel() for p in params) * 4 + sum(m.shape[0] * m.shape[1] * 4 for m in quantized)
print(json.dumps({"seconds": seconds, "peak_mib": (kib() - before) / 1024, "loaded_mib": loaded / 2**20,
                  "anon_mib": (max(peak_anon) - anon_before) / 1024,
                  "float32_mib": float32 / 2**20}))
"""


def file_mib(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.iterdir() if f.suffix in (".safetensors", ".gguf")]
    return sum(f.stat().st_size for f in files) / 2**20


def load_once(model: str, dtype: str, quantization: str | None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, dtype, quantization or ""], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["int8", "int4"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not args.models:
        from octavo.default_model import default_gguf_path, default_model_path

        args.models = [str(default_model_path() if args.quantization else default_gguf_path())]
    for model in args.models:
        runs = [load_once(model, args.dtype, args.quantization) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["seconds"])
        print(f"{Path(model).name}: files {file_mib(Path(model)):.0f} MiB, weights as loaded "
              f"{best['loaded_mib']:.0f} MiB, in float32 {best['float32_mib']:.0f} MiB")
        for r in runs:
            print(f"  load {r['seconds']:.2f} s, peak growth: anonymous {r['anon_mib']:.0f} MiB, "
                  f"RSS {r['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
