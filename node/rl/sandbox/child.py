"""The program that runs inside the sandbox: sets the limits, runs the code under test, sends back
its values as JSON lines. A real module so it is read, linted and reviewed like the rest; it is
never imported to run: :mod:`node.rl.sandbox.runner` passes this file's text to the sandbox's
interpreter (``python -I -S -B -c``), with the spec's and the results' descriptors as arguments.
Nothing of primenode is mounted inside, so it imports only the standard library.

Kept cheap to start (issue 15): no ``json`` import inside. The spec comes in as ``marshal`` data
(node -> sandbox only: nothing from the sandbox is ever unmarshalled by the node); results go out
as JSON lines built by ``_enc`` with the C string encoder of ``_json`` and are parsed by the node
with ``json.loads`` alone. io cases run in a fork of the child (limits already set; RLIMIT_FSIZE in
the fork, so a large stdin can be staged) that runs the program as ``python -I -S solution.py``
would, interpreter exit included; no second interpreter start, no ``subprocess`` import.
"""
# mypy: ignore-errors
# The names start with "_" so the program under test (which runs in this interpreter) does not
# trip over them; nothing runs on import.

if __name__ == "__main__":
    import marshal
    import os
    import resource
    import sys
    from _json import encode_basestring_ascii as _q

    _spec_fd, _out_fd = int(sys.argv[1]), int(sys.argv[2])
    with open(_spec_fd, "rb") as _fh:
        _spec = marshal.loads(_fh.read())
    _mode, _code, _steps, _limits, _max = (
        _spec["mode"],
        _spec["code"],
        _spec["steps"],
        _spec["limits"],
        _spec["max_output"],
    )
    _fsize = _limits.pop("RLIMIT_FSIZE") if _mode == "io" else None  # io: set in each case's process
    for _name, _v in _limits.items():
        resource.setrlimit(getattr(resource, _name), (_v, _v))
    _write, _os_exit, _stdout, _stderr = os.write, os._exit, sys.stdout, sys.stderr

    def _exit(code):
        for _s in (_stdout, _stderr):
            try:
                _s.flush()
            except BaseException:
                pass
        _os_exit(code)

    _left = _spec["max_result"]  # the node reads no more: stop before writing more (io mode has no RLIMIT_FSIZE)

    def _emit(line):
        global _left
        _b = (line + "\n").encode()
        _left -= len(_b)
        if _left < 0:
            _exit(1)
        while _b:
            _b = _b[_write(_out_fd, _b) :]

    _emit('{"started":true}')
    _type, _repr, _isfinite, _join = type, repr, __import__("math").isfinite, ",".join

    def _enc(x, depth=0):
        t = _type(x)
        if depth > 100:
            raise ValueError("nested too deep")
        if x is None:
            return "null"
        if t is bool:
            return "true" if x else "false"
        if t is int:
            return _repr(x)
        if t is str:
            return _q(x)
        if t is float:
            return _repr(x) if _isfinite(x) else '{"float":"' + _repr(x) + '"}'
        if t is list:
            return "[" + _join([_enc(v, depth + 1) for v in x]) + "]"
        if t is tuple:
            return '{"tuple":[' + _join([_enc(v, depth + 1) for v in x]) + "]}"
        if t is dict:
            return (
                '{"dict":['
                + _join(["[" + _enc(k, depth + 1) + "," + _enc(v, depth + 1) + "]" for k, v in x.items()])
                + "]}"
            )
        if t is set or t is frozenset:
            return '{"' + t.__name__ + '":[' + _join([_enc(v, depth + 1) for v in x]) + "]}"
        if t is bytes:
            return '{"bytes":"' + x.hex() + '"}'
        raise TypeError("not plain data: " + t.__name__)

    del _spec, _name, _v, _fh
    if _mode == "io":
        for _i, _step in enumerate(_steps):
            _in = os.memfd_create("stdin")
            _b = _step["stdin"].encode()
            while _b:
                _b = _b[_write(_in, _b) :]
            os.lseek(_in, 0, 0)
            _r, _w = os.pipe()
            _pid = os.fork()
            if _pid == 0:  # this case's process: falls through to run the program as a script
                _null = os.open("/dev/null", os.O_WRONLY)
                os.dup2(_in, 0)
                os.dup2(_w, 1)
                os.dup2(_null, 2)
                for _fd in (_in, _r, _w, _null, _out_fd):
                    os.close(_fd)
                resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
                break
            os.close(_in)
            os.close(_w)
            _got, _n = [], 0
            while _chunk := os.read(_r, 65536):
                if _n < _max:
                    _got.append(_chunk)
                    _n += len(_chunk)
            os.close(_r)
            _rc = os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1])
            _emit(
                '{"i":'
                + _repr(_i)
                + ',"v":'
                + _q(b"".join(_got)[:_max].decode("utf-8", "replace"))
                + ',"rc":'
                + _repr(_rc)
                + "}"
            )
        else:
            _emit('{"done":true}')
            _exit(0)
        _main = _type(sys)("__main__")
        _main.__file__, _main.__builtins__ = "solution.py", __builtins__
        sys.modules["__main__"], sys.argv = _main, ["solution.py"]
        exec(compile(_code, "solution.py", "exec"), _main.__dict__)  # as `python -I -S solution.py` would
    else:
        _ns = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(_code, "solution.py", "exec"), _ns)
        except BaseException as _e:
            _emit('{"error":' + _q(_type(_e).__name__) + "}")
            _exit(1)
        for _i, _step in enumerate(_steps):
            try:
                if "exec" in _step:
                    exec(compile(_step["exec"], "<test>", "exec"), _ns)
                    continue
                _emit('{"i":' + _repr(_i) + ',"v":' + _enc(eval(compile(_step["eval"], "<test>", "eval"), _ns)) + "}")
            except BaseException as _e:
                _emit('{"i":' + _repr(_i) + ',"error":' + _q(_type(_e).__name__) + "}")
                _exit(1)
        _emit('{"done":true}')
        _exit(0)
