import threading

import pytest
import torch

import octavo
from octavo import _C

CPU_FEATURE_KEYS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16",
                    "amx_int8"}


def test_version_is_the_package_version():
    assert octavo.__version__ == _C.__version__
    assert octavo.__version__.count(".") == 2


def test_cpu_features_is_a_dict_of_bools():
    features = _C.cpu_features()
    assert set(features) == CPU_FEATURE_KEYS
    assert all(isinstance(v, bool) for v in features.values())
    # Each wider extension implies its base.
    if features["avx512bw"] or features["avx512vl"] or features["avx512_bf16"]:
        assert features["avx512f"]


def test_cuda_info():
    assert isinstance(_C.cuda_compiled(), bool)
    count = _C.cuda_device_count()
    assert isinstance(count, int)
    if not _C.cuda_compiled() or not torch.cuda.is_available():
        assert count == 0
    else:
        assert count == torch.cuda.device_count()


def test_cuda_stream_is_set_per_host_thread():
    assert _C.cuda_stream() == 0  # the legacy default stream
    if not _C.cuda_compiled():
        with pytest.raises(ValueError, match="no CUDA kernels"):
            _C.set_cuda_stream(1234)
        return
    _C.set_cuda_stream(1234)  # only stored: nothing launches until a CUDA op runs
    try:
        assert _C.cuda_stream() == 1234
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_C.cuda_stream()))
        thread.start()
        thread.join()
        assert seen == [0]
    finally:
        _C.set_cuda_stream(0)


def test_cpu_isa_controls():
    isas = _C.supported_cpu_isas()
    assert isas[0] == "scalar" and _C.cpu_isa() in isas
    assert octavo.cpu_isa() == _C.cpu_isa()
    with pytest.raises(ValueError, match="'scalar', 'avx2', 'avx512', 'avx512_bf16' or 'amx'"):
        _C.set_cpu_isa("sse9")
    threads = octavo.get_num_threads()
    assert threads >= 1
    with pytest.raises(ValueError, match="at least 1"):
        octavo.set_num_threads(0)
