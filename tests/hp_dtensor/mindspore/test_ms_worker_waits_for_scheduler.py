"""A MindSpore worker joins its job only once the scheduler accepts connections: a worker that
connects first registers through MindSpore's reconnect path, which took 10 to 20 s to succeed on
a loaded 2-core machine; waiting for the scheduler's port made a 4-rank start about twice as fast."""

from __future__ import annotations

import socket
import threading
import time

from hp_dtensor.platform.mindspore.process_group import _wait_for_scheduler


def test_a_worker_waits_until_its_scheduler_listens() -> None:
    with socket.socket() as scheduler:
        scheduler.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused
        port = scheduler.getsockname()[1]
        listening = threading.Event()

        def listen_later() -> None:
            time.sleep(0.3)
            scheduler.listen()
            listening.set()

        starter = threading.Thread(target=listen_later)
        starter.start()
        _wait_for_scheduler("127.0.0.1", port, limit_s=60)
        assert listening.is_set()
        starter.join()


def test_a_scheduler_that_never_listens_is_left_to_init_to_report() -> None:
    with socket.socket() as nobody:
        nobody.bind(("127.0.0.1", 0))
        _wait_for_scheduler("127.0.0.1", nobody.getsockname()[1], limit_s=0.3)  # returns: init() reports it
