"""What torchrun starts in a rank's place in the test suite: `forked_rank.py ARGV...` has the
zygote (tests/helpers/zygote.py) fork `python ARGV...` with this process's environment, folder and
standard streams, relays every signal it gets to the fork, and exits as the fork did. Standard
library only: it costs ~30 ms, the fork none of a rank's imports."""

import json
import os
import signal
import socket
import sys

conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(os.environ["RAYLANE_TESTS_ZYGOTE_SOCKET"])
request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
pid = json.loads(conn.recv(65536))["pid"]


def relay(signum, _frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, relay)
reply = conn.recv(65536)  # the fork's end; a signal's handler runs and the wait goes on
code = json.loads(reply)["code"] if reply else 1
if code < 0:  # ended by a signal: so does this process, for torchrun to report it as such
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
