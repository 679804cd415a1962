"""Several hosts on one machine: network namespaces on a bridge (root only), a lab connected to
their engines with `Lab.connect`, pipelines across them, and a link slowed with netem that the
simulator, given the link pplab measures, predicts.

Notebook 12 runs on such hosts too, and asserts what it shows: a stalled rank named within the
lab's timeout, a link cut mid-step named by rank, peer and action, and training resumed after a
kill exactly as the uninterrupted run; those are not repeated here."""

import dataclasses
import os
import signal
import statistics
import subprocess
import time

import pytest

import pplab
from pplab.base.machine import LoadWatch
from pplab.drivers.cluster.namespaces import INTERFACE, NamespaceHosts
from timing import slack, within

WHY_NOT = NamespaceHosts.why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"namespace hosts: {WHY_NOT}")
CONFIG = pplab.LlamaConfig.tiny()


def nothing_left(hosts: NamespaceHosts) -> None:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in hosts.names), namespaces
    assert f"ppl{hosts.tag}" not in links and f"pplbr{hosts.tag}" not in links, links
    assert all(process.poll() is not None for process in hosts.processes) or not hosts.processes


@pytest.fixture(scope="module")
def hosts():
    made = NamespaceHosts(n_hosts=2, engines_per_host=2).start()
    try:
        yield made
    finally:
        made.stop()
        nothing_left(made)


@pytest.fixture(scope="module")
def lab(hosts):
    lab = pplab.Lab.connect(**hosts.connect_options(), n_ranks=4, op_timeout=30, verbose=False)
    try:
        yield lab
    finally:
        lab.stop()


def test_a_wrong_interface_name_is_refused_within_seconds_naming_the_ones_there(hosts):
    # Checked before any rank waits: well within the 60 s a rank would wait for a peer.
    with within(15), pytest.raises(pplab.session.RankFailedError,
                                   match=r"gloo_ifname='eth9': host pplab-\w+-h\d has no such network "
                                         r"interface; it has lo, pplab0, pplab1"):
        pplab.Lab.connect(**{**hosts.connect_options(), "gloo_ifname": "eth9"}, n_ranks=4, op_timeout=60,
                          verbose=False)


def sent_bytes():
    """Bytes this engine's host has sent on its own interface (the engine's namespace's /sys)."""
    import os
    import socket

    from pplab.drivers.cluster.namespaces import INTERFACE

    with open(f"/sys/class/net/{INTERFACE}/statistics/tx_bytes") as f:
        return socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME"), int(f.read())


def test_ranks_are_grouped_by_host_and_talk_over_the_hosts_interfaces(lab, hosts):
    host_of_rank = [row.host for row in lab.status()]
    assert sorted(set(host_of_rank)) == sorted(hosts.names)
    assert host_of_rank[0] == host_of_rank[1] != host_of_rank[2] == host_of_rank[3]  # contiguous per host
    assert [row.local_rank for row in lab.status()] == [0, 1, 0, 1]
    before = lab.run(sent_bytes)
    assert [(host, ifname) for host, ifname, _ in before] == [(host, INTERFACE) for host in host_of_rank]

    pipe = lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=4)
    parity = pipe.check_parity()
    assert parity.passed, str(parity)
    after = lab.run(sent_bytes)
    # Rank 1 sends 4 activations to rank 2 on the other host: they crossed rank 1's interface.
    activation = 2 * 32 * CONFIG.hidden_size * 4  # the default batch: microbatches of 2 x 32 tokens
    assert after[1][2] - before[1][2] >= 4 * activation
    pipe.close()


@pytest.fixture(scope="module")
def two_hosts():
    """Two hosts of one engine each, and a 2-rank lab across them."""
    made = NamespaceHosts(n_hosts=2, engines_per_host=1).start()
    lab = None
    try:
        # 30 s for a wait between ranks: a slowed link on busy cores; the faults' pipelines set 8 s
        lab = pplab.Lab.connect(**made.connect_options(), n_ranks=2, op_timeout=30, verbose=False)
        yield made, lab
    finally:
        if lab is not None:
            lab.stop()
        made.stop()
        nothing_left(made)


def measure_link(nbytes_list):
    """On each rank: the one-way time of a message of each size, pplab's StageLink (engine namespace)."""
    from pplab.rank.profiler import hop_costs_on_rank
    from pplab.rank.rank_context import rank_context

    me = rank_context()
    # Two rounds warm the link up: each takes most of a second on the slowed link, and ten took 10 s.
    return [hop_costs_on_rank(me.rank, me.world_size, nbytes, repeats=6, warmup=2) for nbytes in nbytes_list]


def test_a_slow_link_is_predicted_from_the_link_pplab_measures(two_hosts):
    """The link's costs from pplab's measurement of it, the compute costs from each slowed step's
    own F and B (the CPU may be busier now than a minute ago: the suite shares it): the simulator
    predicts the waits on the wire, and with them the step. Measured here: 7-8 % above the
    prediction (the link's two directions also carry each other's ACKs, which the model leaves
    out). The other test worker can starve the ranks and gloo's transport threads for a whole
    step (seen in a full run: one step 1.0x its prediction, the next three 1.2-1.4x): load only
    ever adds time, so the step closest to the quiet machine's is compared, within 15 % when the
    machine was quiet through the steps (a busy one makes gloo's threads answer the link late)."""
    from pplab.planning.simulator import costs_from_timeline

    hosts, lab = two_hosts
    microbatch_size, seq_len, m = 4, 64, 8
    activation = microbatch_size * seq_len * CONFIG.hidden_size * 4
    pipe = lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=m)
    batch = next(pplab.data.batches(microbatch_size * m, seq_len))

    # 5 ms one way at 100 Mbit/s where the kernel has netem; else a 5 Mbit/s token bucket.
    shaping = dict(delay_ms=5, rate_mbit=100) if hosts.has_netem() else dict(rate_mbit=5)
    hosts.shape_link(**shaping)
    small, large = lab.run(measure_link, [activation // 4, activation])[0]
    bandwidth = (activation - activation // 4) / (large["pplab"] - small["pplab"])
    latency = max(large["pplab"] - activation / bandwidth, 0.0)
    assert bandwidth == pytest.approx(shaping["rate_mbit"] * 1e6 / 8, rel=0.3)  # what was set, measured
    if "delay_ms" in shaping:
        assert 4e-3 < latency < 8e-3

    def predicted(timeline):  # a link carries one message at a time: on a slow one, messages queue
        costs = dataclasses.replace(costs_from_timeline(timeline, 2), latency=latency, bandwidth=bandwidth,
                                    activation_bytes=activation, link_contention=True)
        return pplab.simulate(pipe.schedule, costs).step_time()

    with LoadWatch() as load:
        steps = [pipe.step(batch).timeline for _ in range(4)][1:]  # the first warms the slowed link up
    measured = statistics.median(t.step_time() for t in steps)
    ratio = min(t.step_time() / predicted(t) for t in steps)
    print(f"slow link: measured {measured:.4f} s, {ratio - 1:+.1%} against the prediction "
          f"(the machine's slowdown {load.slowdown:.2f})")
    said = [(t.step_time(), predicted(t)) for t in steps]
    assert ratio >= 0.85, said  # the link's waits are there: the prediction is no faster than the run
    # On busy cores gloo's threads answer the slowed link late, which the model leaves out: how close
    # the prediction comes is bench/bench_hosts.py's claim, and asserted here on a quiet machine only.
    if load.slowdown < 1.2:
        assert ratio <= 1.15, said
    # The link sets the pace: the ranks wait on the wire more than they compute (at a quiet machine's
    # pace: beside a whole other suite, the load stretched the compute 25-fold, not the wire).
    timeline = steps[-1]
    busy = sum(timeline.busy_time(r) for r in range(2)) / load.slowdown
    assert sum(timeline.comm_time(r) for r in range(2)) > busy, (busy, load.slowdown)
    pipe.close()
    hosts.shape_link()  # a clean link again


def a_slow_step_under_way(hosts, lab):
    """A pipeline (every wait between ranks bounded by 8 s) whose step takes about a second, started
    and under way: each rank has finished an action of it. (A fixed 0.3 s was not enough beside two
    burners: the kill landed while rank 0 still waited at the step's opening barrier.)"""
    pipe = lab.pipeline(CONFIG, schedule="1f1b", n_microbatches=8, op_timeout=8)
    assert pipe.step().loss > 0
    hosts.shape_link(rate_mbit=5)
    running = pipe.start_step(next(pplab.data.batches(4 * 8, 64)), live_interval=0.05)  # 64 KiB activations
    acted, deadline = set(), time.monotonic() + slack(30)
    while acted != {0, 1} and time.monotonic() < deadline:
        acted |= {item.rank for _, item in running.poll() if isinstance(item, pplab.Event)}
        time.sleep(0.02)
    assert acted == {0, 1}, f"the step did not get under way on every rank (actions seen from {acted})"
    return running


def test_a_rank_killed_mid_step_is_named_by_its_peer(two_hosts):
    """SIGKILL to the rank on the other host while a step runs: its peer's next message fails and
    says to or from whom, and for which action."""
    hosts, lab = two_hosts  # the last test here: the lab it breaks is restarted below anyway
    running = a_slow_step_under_way(hosts, lab)
    os.kill(lab.status()[1].pid, signal.SIGKILL)
    # Rank 0's error, or the lab seeing rank 1's process gone first (a busy machine): either way the
    # message says what rank 0 lost, to or from whom. Most runs, the dead process's closed connection
    # fails rank 0's message at once ("lost"); about one full run in five, gloo did not wake a receive
    # already posted and rank 0 waited out its op_timeout of 8 s (fresh-clone run at dd0f20f), which
    # the message then says instead: both are bounded and name the action.
    lost = r"rank 0 (lost the (send of the )?(activation|gradient) of microbatch \d+ (to|from) rank 1|" \
           r"waited \d+ s for the (activation|gradient) of microbatch \d+ from rank 1) " \
           r"\(action 0(SEND|RECV)_[FB]\d+\)"
    with within(5 + lab.grace, plus=8), pytest.raises(
            (pplab.session.RankFailedError, pplab.session.RankDiedError), match=lost):
        running.result()
    assert lab.state.startswith("needs restart")
    # The controller stops hearing the dead engine's heartbeat: the lab's status says so.
    deadline = time.monotonic() + 20
    while lab.status()[1].state != "dead" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [row.state for row in lab.status()] == ["idle", "dead"]
    hosts.shape_link()
    lab.restart()  # through Lab.connect(restart_engines=...): new engines on the same hosts
    assert sorted({row.host for row in lab.status()}) == sorted(hosts.names)
    parity = lab.pipeline(CONFIG, schedule="zb-h1", n_microbatches=4).check_parity()
    assert parity.passed, str(parity)
