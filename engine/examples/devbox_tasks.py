"""The Python functions of the devbox's example workload (``docs/devbox.md``).

The devbox's worker has this directory on its ``PYTHONPATH``, so the ``python`` plugin imports
``devbox_tasks:score`` in the warm pool of the workload's reusable environment: the first
action of the environment starts the pool process, the follow-on actions run in that same
process (no interpreter start, no import). Each call appends its process id to ``out``, which
is how the devbox's summary shows the reuse.
"""

import os


def score(out, n=20000, inputs=None):
    """A little real work (a sum of squares), then one line ``PID INPUTS`` appended to
    ``out``; returns the sum."""
    total = sum(i * i for i in range(int(n)))
    with open(out, "a") as f:
        f.write(f"{os.getpid()} {inputs}\n")
    return total
