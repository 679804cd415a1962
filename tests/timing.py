"""How long "at once" may take in a test: the suite runs on 2 shared cores, beside other work.

A test that bounds a wall time allows this many seconds beyond what it asserts about (a
grace period, a timeout). That is well below every length it tells apart: a lab's start,
a call's own timeout, a wait that never ends.
"""

SLACK = 5.0
