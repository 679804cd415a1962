"""The suite's CPU count (budget.py) never goes back: a process that ends outside the tree keeps the
CPU-seconds it was last seen with."""

import subprocess
import sys
import time

from budget import ProcessTree

# A child that starts a grandchild and exits at once: the grandchild, reparented to init, burns
# CPU for a while, then ends where none of our processes can reap it.
BURNER = ("import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\n"
          "time.sleep(0.5)")
ORPHANING_CHILD = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "{BURNER}"], start_new_session=True)
"""


def test_the_count_keeps_what_a_process_that_left_the_tree_was_last_seen_with():
    tree = ProcessTree()
    counts = [tree.cpu_seconds()]
    child = subprocess.Popen([sys.executable, "-c", ORPHANING_CHILD])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        counts.append(tree.cpu_seconds())
        if child.poll() is not None:
            break
        time.sleep(0.01)
    child.wait()
    time.sleep(1.5)  # the grandchild burns its 0.6 s, then ends outside the tree
    counts.append(tree.cpu_seconds())
    back = [(i, earlier, later) for i, (earlier, later) in enumerate(zip(counts, counts[1:]))
            if later < earlier - 1e-6]
    assert not back, back
    assert counts[-1] - counts[0] > 0.05  # the child's start-up at least: reaped by us, counted
