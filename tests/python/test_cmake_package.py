"""The installed wheel carries a CMake package an unrelated C++ project can build against."""

import shutil
import subprocess
from pathlib import Path

import pytest

import octavo

CONSUMER = Path(__file__).resolve().parents[1] / "cmake_consumer"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_consumer_builds_against_installed_wheel(tmp_path):
    cmake_dir = Path(octavo.cmake_dir())
    assert (cmake_dir / "octavoConfig.cmake").is_file()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = tmp_path / "build"

    def run(*cmd):
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    run("cmake", "-S", CONSUMER, "-B", build, *generator, f"-Doctavo_DIR={cmake_dir}")
    run("cmake", "--build", build)
    out = run(build / "octavo_consumer")
    assert "octavo consumer ok" in out


def test_cmake_dir_is_inside_the_installed_package():
    assert Path(octavo.cmake_dir()).is_relative_to(Path(octavo.__file__).resolve().parent)
