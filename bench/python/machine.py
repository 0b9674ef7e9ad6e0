"""The line every benchmark prints about the CPU it ran on: model name and the SIMD flags that
choose Octavo's kernel level (sessions run on different machines; compare only figures from one)."""
import platform
from pathlib import Path


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2"))]
    return f"{model}; flags {' '.join(sorted(set(wanted)))}"
