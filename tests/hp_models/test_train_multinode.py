"""The trainer under two launchers, as on two nodes: ``torchrun --nnodes 2 --nproc-per-node 2``
twice over a localhost rendezvous, HSDP with its two replicas on the two "nodes" (ranks 0-1 and
2-3 each hold one whole sharded copy; the replica groups {0, 2} and {1, 3} cross the nodes).  The
losses equal the same job spawned by one launcher, and a launcher whose peer never comes fails
within its rendezvous timeout instead of hanging.

The lone launcher mostly waits (10 s for a peer that never comes): it starts with the module, so its
wait overlaps the two-launcher run instead of adding to the file's time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB = ["--job", str(EXAMPLES / "qwen3_5_hsdp.yaml"), "--steps", "4", "--seq-len", "32"]


def _env() -> dict[str, str]:
    # the launchers and their ranks import this checkout's packages as the test does
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(node: int, port: int, out: Path, extra: list[str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
           *(extra or []), "-m", "hp_models.train", *JOB, "--out-dir", str(out)]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    try:
        return [(p.wait(timeout=timeout), p.stdout.read() if p.stdout else "") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module", autouse=True)
def lone_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """Node 0 of two, alone, started before the module's first test (its peer never comes)."""
    proc = _torchrun(0, _free_port(), tmp_path_factory.mktemp("alone"), ["--rdzv-conf", "timeout=10"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_launchers_equal_one(tmp_path: Path) -> None:
    port = _free_port()
    two = tmp_path / "two-nodes"
    results = _finish([_torchrun(node, port, two) for node in (0, 1)], timeout=300)
    for node, (code, text) in enumerate(results):
        assert code == 0, f"node {node} launcher exited {code}:\n{text[-3000:]}"
    one = tmp_path / "one-launcher"
    spawned = subprocess.run([sys.executable, "-m", "hp_models.train", *JOB, "--nproc", "4", "--out-dir", str(one)],
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert spawned.returncode == 0, spawned.stdout[-2000:] + spawned.stderr[-3000:]

    log_two = json.loads((two / "log.json").read_text())
    log_one = json.loads((one / "log.json").read_text())
    par = log_two["parallelism"]
    assert (par["dp_replicate"], par["dp_shard"], par["tp"], par["world_size"]) == (2, 2, 1, 4), par
    assert log_one["parallelism"] == par
    a, b = log_two["losses"], log_one["losses"]
    assert len(a) == len(b) == 4
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    # the same ranks in the same layout run the same reductions: equal up to the last bit or two
    assert worst <= 1e-6, (a, b)
    print(f"HSDP over two launchers (2 ranks each) equals one launcher of 4 ranks: 4 losses, worst relative "
          f"difference {worst:.1e}")


def test_a_node_whose_peer_never_comes_fails_instead_of_hanging(lone_node: subprocess.Popen[str]) -> None:
    """Node 0 alone: its rendezvous waits for node 1 and gives up after the rendezvous timeout
    (``--rdzv-conf timeout=10``), exiting non-zero with the launcher's own error, never a hang."""
    (code, text), = _finish([lone_node], timeout=240)
    assert code != 0, text[-2000:]
    assert "1/2 clients joined" in text, text[-2000:]
