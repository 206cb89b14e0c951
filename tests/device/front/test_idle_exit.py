"""`--idle-exit`: the device stops once it has had no connection for that
long (an open connection, even a silent one, keeps it), and removes only its
own socket."""
import os
import socket
import time

from conftest import SMALL, Device

from dspx.transport import connect, file_id, unlink_if


def test_idle_exit_waits_for_the_last_connection():
    dev = Device(*SMALL, "--idle-exit", "1")
    try:
        ep = connect(dev.path)  # says nothing for three idle periods
        time.sleep(3)
        assert dev.alive(), dev.output()
        ep.close()
        assert dev.proc.wait(60) == 0, dev.output()
        assert "no connection for 1 s; stopping (idle exit)" in dev.output()
        assert not os.path.exists(dev.path)
    finally:
        dev.stop()


def test_a_device_removes_only_its_own_socket(tmp_path):
    path = str(tmp_path / "dsp0.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    ours = file_id(path)
    s.close()
    os.unlink(path)
    time.sleep(0.05)  # a successor is a new process, started well after one tick of the file clock
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)  # a successor bound the same name meanwhile
    unlink_if(path, ours)
    assert os.path.exists(path)
    unlink_if(path, file_id(path))
    assert not os.path.exists(path)
    s.close()
