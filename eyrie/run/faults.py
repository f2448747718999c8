"""Fault injection at named points, for fault drills and the tests that prove recovery on the real stack.

`EYRIE_FAULTS` lists `point=action` pairs, comma separated, e.g. `vocab.before-manifest=kill` or
`extract.shard-00001=raise`. Actions:
  kill   SIGKILL this process on the spot: a crash with no clean-up, as an OOM kill or a lost node gives;
  raise  raise InjectedFault, as any bug or transient error in that step would;
  enospc raise OSError(ENOSPC), as a full disk would.
`EYRIE_FAULTS_WHILE=<file>` arms the faults only while that file exists, so a drill can show an operator's fix
(delete the file) followed by a retry. With neither variable set every point is a no-op.
"""

from __future__ import annotations

import errno
import os
import signal

ACTIONS = ("kill", "raise", "enospc")


class InjectedFault(RuntimeError):
    """Raised at a point named in EYRIE_FAULTS with the `raise` action."""


def armed_faults(env=os.environ) -> dict[str, str]:
    spec = env.get("EYRIE_FAULTS", "").strip()
    if not spec:
        return {}
    while_file = env.get("EYRIE_FAULTS_WHILE")
    if while_file and not os.path.exists(while_file):
        return {}
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, action = item.partition("=")
        if action not in ACTIONS:
            raise ValueError(f"EYRIE_FAULTS entry {item!r}: the action must be one of {', '.join(ACTIONS)}")
        faults[point.strip()] = action
    return faults


def fault_point(name: str) -> None:
    """Fail here if EYRIE_FAULTS names this point (and EYRIE_FAULTS_WHILE, when set, exists)."""
    action = armed_faults().get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"fault injected at {name} (EYRIE_FAULTS)")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault injected at {name})")
