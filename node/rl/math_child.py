"""The symbolic math checker's helper process (started by :class:`node.rl.math_reward.SymbolicHelper`
as ``python -I math_child.py MEMORY_BYTES``): one JSON request per line on stdin
(``pred``, ``gold``, ``timeout``), one line back, ``1`` equal or ``0`` not (or unknown).

Run as a file in isolated mode, it imports only the standard library and math-verify. Its
address space is capped at MEMORY_BYTES and it dumps no core; whatever math-verify raises
(a timeout, MemoryError, RecursionError, a parser bug) is "not equal". It says ``ready``
once math-verify is imported (the parent waits for that, not for a sleep).
"""

import json
import resource
import sys


def main() -> None:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from math_verify import parse, verify

    def check(pred: str, gold: str, timeout: int) -> bool:
        g = parse("$" + gold + "$", parsing_timeout=timeout)
        p = parse("$" + pred + "$", parsing_timeout=timeout)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=timeout))

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            ok = check(req["pred"], req["gold"], req["timeout"])
        except BaseException:  # a timeout, MemoryError, RecursionError, a parser bug: not equal
            ok = False
        sys.stdout.write(("1" if ok else "0") + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
