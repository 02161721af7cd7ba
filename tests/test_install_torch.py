"""``make install``'s torch choice (tools/install_torch.py), run as make runs it but with ``--dry-run``: which
build a machine gets with and without an NVIDIA GPU, with PyTorch's CPU index reachable or not, and never a
second torch where one is installed. Nothing is downloaded: the GPU is a stand-in ``nvidia-smi`` on PATH and the
index a local HTTP server (reachable) or a closed port (not)."""

import http.server
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "install_torch.py"
sys.path.insert(0, str(SCRIPT.parent))
from install_torch import CPU_INDEX, choose  # noqa: E402  the tool is a script, not a package

PIN = "torch==2.13.0"


def test_the_choice_per_platform():
    assert choose("Linux", gpu=False, index_reachable=True) == (
        ["--index-url", CPU_INDEX], f"no NVIDIA GPU: the CPU-only wheel from {CPU_INDEX}")
    extra, reason = choose("Linux", gpu=False, index_reachable=False)
    assert extra == [] and "cannot be reached: PyPI's wheel instead" in reason
    assert choose("Linux", gpu=True, index_reachable=None)[0] == []
    assert choose("Darwin", gpu=False, index_reachable=None)[0] == []


@pytest.fixture
def machine(tmp_path):
    """A PATH with nothing but what a case puts there, and stand-ins for an interpreter in which ``import torch``
    fails (the script only asks it that) and one in which it works."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bare, equipped = tmp_path / "python-without-torch", tmp_path / "python-with-torch"
    for stand_in, status in ((bare, 1), (equipped, 0)):
        stand_in.write_text(f"#!/bin/sh\nexit {status}\n")
        stand_in.chmod(0o755)

    def install(*options, gpu=False, python=str(bare)):
        if gpu:
            smi = bin_dir / "nvidia-smi"
            smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
            smi.chmod(0o755)
        done = subprocess.run([sys.executable, str(SCRIPT), PIN, "--python", python, "--dry-run", *options],
                              capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()
    return install, str(bare), str(equipped)


@pytest.fixture
def local_index(tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/"  # nothing listens once this closes


def test_without_a_gpu_the_cpu_index_when_it_answers(machine, local_index):
    install, python, _ = machine
    lines = install("--index", local_index)
    assert lines[0] == f"torch: no NVIDIA GPU: the CPU-only wheel from {local_index}"
    assert lines[1] == f"would run: {python} -m pip install -q --index-url {local_index} {PIN}"
    assert lines[-1] == f"would run: {python} -m pip install -q torch>=2.8"  # PyPI, had the CPU index failed


def test_without_a_gpu_and_without_the_index_pypi_saying_so(machine):
    install, python, _ = machine
    lines = install("--index", closed_port_url())
    assert "cannot be reached: PyPI's wheel instead" in lines[0]
    assert lines[1:] == [f"would run: {python} -m pip install -q {PIN}", f"would run: {python} -m pip install -q "
                                                                           "torch>=2.8"]


def test_with_a_gpu_pypis_cuda_build_and_the_index_is_not_asked(machine):
    install, python, _ = machine
    lines = install("--index", closed_port_url(), gpu=True)
    assert lines[0].startswith("torch: an NVIDIA GPU is present: PyPI's wheel")
    assert lines[1] == f"would run: {python} -m pip install -q {PIN}"


def test_a_torch_already_there_is_never_replaced(machine):
    install, _, equipped = machine
    assert install(gpu=True, python=equipped) == ["torch: already installed here; left as it is"]
