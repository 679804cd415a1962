"""What the lab relies on in gloo's errors: torch gives them no type of their own, so their text tells.

Nothing else in pplab reads gloo's messages. tests/test_adapters.py provokes the real
error on two gloo ranks, so a torch that words that error otherwise fails there.
"""

from __future__ import annotations

# gloo's TCP transport raises a plain RuntimeError for a raw send/recv that timed out or
# lost its peer, its message starting with the C++ source file it came from:
#   [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete
#   [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
# Either way the pair to that peer is closed: the process group cannot be used again.
GLOO_TRANSPORT_SOURCE = "gloo/transport/"


def gloo_transport_failed(error: BaseException) -> bool:
    """True for gloo's error of a raw send/recv that timed out or lost its peer (its pair is closed)."""
    return isinstance(error, RuntimeError) and gloo_transport_said(str(error))


def gloo_transport_said(text: str) -> bool:
    """True for the text of such an error, as a rank reported it (e.g. a RemoteError's)."""
    return GLOO_TRANSPORT_SOURCE in text
