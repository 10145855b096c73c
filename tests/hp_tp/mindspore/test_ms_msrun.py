# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped"
"""``msrun``, MindSpore's own launcher, starts a 2-rank job that calls init_device_mesh with no
further setup: the ranks join through the variables msrun sets and a TP MLP matches one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_msrun_starts_a_tp_job():
    with tempfile.TemporaryDirectory() as out:
        env = {
            **os.environ, "HP_MSRUN_OUT": out, "HYPER_PARALLEL_PLATFORM": "mindspore", "GLOG_v": "3",
            # msrun starts workers with the `python` on PATH; make it this interpreter, on this sys.path.
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join([HERE] + [p for p in sys.path if p]),
        }
        launcher = "import sys; from mindspore.parallel.cluster.run import main; sys.argv[0] = 'msrun'; sys.exit(main())"
        cmd = [sys.executable, "-c", launcher, "--worker_num=2", "--local_worker_num=2",
               f"--master_port={_free_port()}", f"--log_dir={out}/logs", "--join=True",
               os.path.join(HERE, "msrun_job.py")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        logs = ""
        if os.path.isdir(f"{out}/logs"):
            for name in sorted(os.listdir(f"{out}/logs")):
                with open(f"{out}/logs/{name}") as f:
                    logs += f"--- {name}\n" + f.read()[-3000:]
        assert proc.returncode == 0, proc.stderr[-2000:] + logs
        results = []
        for r in range(2):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
    assert [(res["rank"], res["world"]) for res in results] == [(0, 2), (1, 2)]
    for res in results:
        assert res["out_diff"] < 1e-5 and res["dx_diff"] < 1e-5 and res["down_bias_diff"] < 1e-5, res
