"""The pid-reuse trap of issue 20, as a hostile tenant builds it (no CUDA involved).

Usage: python3 -c "$(cat trap.py)" SOCKET HELLO_HEX (run by `tessera_testkit::trap::set`)

A child connects to the tenant socket, sends HELLO_HEX (a `Hello` frame with the tenant's
token, encoded by the Rust test), reads the first bytes of the answer, passes the connected
socket to the parent over SCM_RIGHTS and exits. The parent reaps it and prints
{"trap": CHILD_PID, "answer": N_BYTES}, then holds the socket open until a line arrives on stdin, so the
arbiter keeps a connection whose process is gone.
"""
import json
import os
import socket
import sys


def main():
    path, hello = sys.argv[1], bytes.fromhex(sys.argv[2])
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        parent_end.close()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        conn.sendall(hello)
        answer = conn.recv(4096)
        socket.send_fds(child_end, [len(answer).to_bytes(4, "little")], [conn.fileno()])
        os._exit(0)
    child_end.close()
    msg, fds, _, _ = socket.recv_fds(parent_end, 4, 1)
    os.waitpid(pid, 0)
    held = socket.socket(fileno=fds[0])
    print(json.dumps({"trap": pid, "answer": int.from_bytes(msg, "little")}), flush=True)
    sys.stdin.readline()
    held.close()


main()
