"""Runs one candidate solution inside the sandbox; copied there as `harness.py` by CodeReward.

    python -I harness.py stdio          # solution.py as a script on this process's stdin
    python -I harness.py call NAME      # NAME(*args.json), or Solution().NAME(*args); prints JSON
    python -I harness.py check          # solution.py, then check.py in its namespace; prints token

Before the solution runs, an audit hook refuses sockets and new processes, so a solution that
tries either fails with PermissionError. That is the first wall only; the sandbox's uid, rlimits
and namespaces stop what gets past it (ctypes, for one). The expected outputs never enter the
sandbox: the parent compares.
"""
import json
import sys

_REFUSED = {
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
    "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn",
}


def _refuse(event, args):
    if event in _REFUSED:
        raise PermissionError(f"sandbox: {event} is not allowed")


def _load_solution(namespace=None):
    with open("solution.py") as f:
        code = compile(f.read(), "solution.py", "exec")
    sys.argv = ["solution.py"]
    namespace = namespace if namespace is not None else {"__name__": "__main__", "__builtins__": __builtins__}
    exec(code, namespace)
    return namespace


def _check():
    """Passes only if the check code runs to its end after the solution: the token, read and
    deleted before the solution starts, is printed last, so a solution that exits early (exit
    code 0 included) prints no token."""
    import os

    with open("token") as f:
        token = f.read()
    os.remove("token")
    with open("check.py") as f:
        check = compile(f.read(), "check.py", "exec")
    real_stdout = sys.stdout
    namespace = _load_solution()
    exec(check, namespace)
    real_stdout.write("\n" + token + "\n")


def _call(name):
    with open("args.json") as f:
        args = json.load(f)
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # the solution's prints must not mix in
    namespace = _load_solution()
    function = namespace.get(name)
    if not callable(function):
        function = getattr(namespace["Solution"](), name)
    result = function(*args)
    sys.stdout = real_stdout
    print(json.dumps(result, default=repr))


if __name__ == "__main__":
    sys.addaudithook(_refuse)
    if sys.argv[1] == "stdio":
        _load_solution()
    elif sys.argv[1] == "check":
        _check()
    else:
        _call(sys.argv[2])
