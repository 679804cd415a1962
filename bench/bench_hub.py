"""A workshop's hub sized: N seats' servers spawned at once, each starting a 2-rank lab and checking
an exercise, against one seat alone.

One hub (`pplab workshop`, as tests/test_hub.py starts it: loopback, seat accounts made for the run)
serves every round. A round asks the hub for N seats' servers at once (its REST API, as a room of
attendees logging in together would), then in each seat's server starts a kernel that runs lesson
02b as a learner who solved it would: a 2-rank CPU lab, `exercises.check_send_recv` with the
solution, the lab stopped. Per round: when every seat's server was ready and every seat had its
verdict (seconds from the round's start), every verdict right, each seat's lab start, the machine's
CPU-seconds, and the ratio to one seat alone measured in this same run. The servers stop between
rounds, so each round spawns fresh ones.

Run (as root, with configurable-http-proxy): python bench/bench_hub.py [--seats 1 4 8] [--out FILE]
Writes bench/results/hub.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import psutil

from measuring import load

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
RESULT_PATH = HERE / "results" / "hub.json"
BENCH_TOKEN = uuid.uuid4().hex
SEAT_CODE = """
import json, time
started = time.monotonic()
import torch
import torch.distributed as dist
import pplab
from pplab.course import exercises
from pplab.models.llama import loss_fn
lab = pplab.Lab(n_ranks=2, device="cpu", op_timeout=60, verbose=False)
lab_start = time.monotonic() - started
{solution}
verdict = exercises.check_send_recv(lab, forward_backward)
lab.stop()
print(json.dumps({{"right": verdict.right, "lab_start": lab_start,
                  "kernel_seconds": time.monotonic() - started}}))
"""


async def api(hub, method: str, path: str, token: str = BENCH_TOKEN, body: dict | None = None) -> dict:
    from tornado.httpclient import AsyncHTTPClient

    answer = await AsyncHTTPClient().fetch(
        hub.url + path, method=method, headers={"Authorization": f"token {token}"}, request_timeout=600,
        body=None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}),
        raise_error=True)
    return json.loads(answer.body) if answer.body else {}


async def execute(hub, seat: str, token: str, code: str) -> str:
    """Run `code` in a new kernel of `seat`'s server (Jupyter's websocket protocol); what it printed."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    kernel = await api(hub, "POST", f"/user/{seat}/api/kernels", token, {"name": "python3"})
    socket = await websocket_connect(HTTPRequest(
        f"{hub.url.replace('http', 'ws')}/user/{seat}/api/kernels/{kernel['id']}/channels",
        headers={"Authorization": f"token {token}"}))
    message_id = uuid.uuid4().hex
    socket.write_message(json.dumps({
        "header": {"msg_id": message_id, "username": seat, "session": uuid.uuid4().hex,
                   "msg_type": "execute_request",
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    printed = ""
    while True:
        message = json.loads(await socket.read_message())
        if message.get("parent_header", {}).get("msg_id") != message_id:
            continue
        kind = message["header"]["msg_type"]
        if kind == "stream":
            printed += message["content"]["text"]
        elif kind == "error":
            printed += f"{message['content']['ename']}: {message['content']['evalue']}"
        elif kind == "execute_reply":
            socket.close()
            return printed


async def seat_round(hub, seat: str, code: str, start: float) -> dict:
    """One seat: its server asked for, ready, a token of its own, the lesson run; times from `start`."""
    await api(hub, "POST", f"/hub/api/users/{seat}/server")
    while not (await api(hub, "GET", f"/hub/api/users/{seat}")).get("servers", {}).get("", {}).get("ready"):
        await asyncio.sleep(0.2)
    ready = time.monotonic() - start
    token = (await api(hub, "POST", f"/hub/api/users/{seat}/tokens", body={
        "scopes": [f"access:servers!user={seat}"], "note": "bench_hub"}))["token"]
    printed = await execute(hub, seat, token, code)
    try:
        result = json.loads(printed.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"right": False, "error": printed[-500:]}
    return {"seat": seat, "ready": ready, "verdict": time.monotonic() - start, **result}


async def one_round(hub, seats: list[str], code: str) -> dict:
    cpu, start = psutil.cpu_times(), time.monotonic()
    results = await asyncio.gather(*(seat_round(hub, seat, code, start) for seat in seats))
    cpu_after = psutil.cpu_times()
    for seat in seats:  # stopped, so that the next round spawns fresh servers
        await api(hub, "DELETE", f"/hub/api/users/{seat}/server")
    for seat in seats:
        while (await api(hub, "GET", f"/hub/api/users/{seat}")).get("servers"):
            await asyncio.sleep(0.3)
    busy = sum(cpu_after) - sum(cpu) - (cpu_after.idle - cpu.idle) - (cpu_after.iowait - cpu.iowait)
    return {"seats": len(seats), "all_ready": max(r["ready"] for r in results),
            "all_verdicts": max(r["verdict"] for r in results),
            "every_verdict_right": all(r["right"] for r in results),
            "median_lab_start": statistics.median(r.get("lab_start", float("nan")) for r in results),
            "machine_cpu_seconds": round(busy, 1), "per_seat": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seats", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--out", default=str(RESULT_PATH))
    args = parser.parse_args()
    from hub_harness import missing_for_a_hub, workshop_hub
    from pplab.base.machine import measure_load

    missing = missing_for_a_hub()
    if missing:
        raise SystemExit("bench_hub: missing " + "; ".join(missing))
    solution = (HERE.parent / "notebooks" / "solutions" / "02b_exercise_send_recv.py").read_text()
    code = SEAT_CODE.format(solution=solution)
    machine = measure_load()
    print(f"the machine: {machine.describe()}")
    extra = (f"c.JupyterHub.services.append({{'name': 'bench', 'api_token': {BENCH_TOKEN!r}}})\n"
             f"c.JupyterHub.load_roles.append({{'name': 'bench', 'services': ['bench'], "
             f"'scopes': ['admin:users', 'admin:servers', 'tokens', 'access:servers']}})")
    rounds = []
    with workshop_hub(max(args.seats), extra_config=extra) as hub:
        for count in sorted(set([1, *args.seats])):
            result = asyncio.run(one_round(hub, hub.seats[:count], code))
            rounds.append(result)
            print(f"{count} seat(s) at once: every server ready after {result['all_ready']:.1f} s, every "
                  f"verdict after {result['all_verdicts']:.1f} s (right: "
                  f"{result['every_verdict_right']}); median lab start {result['median_lab_start']:.1f} "
                  f"s; {result['machine_cpu_seconds']} CPU-s", flush=True)
    alone = rounds[0]["all_verdicts"]
    for result in rounds:
        result["vs_one_seat"] = round(result["all_verdicts"] / alone, 2)
    print("\n| seats at once | every server ready | every verdict | vs one seat | all right | "
          "median lab start | CPU-s |")
    print("|---|---|---|---|---|---|---|")
    for r in rounds:
        print(f"| {r['seats']} | {r['all_ready']:.1f} s | {r['all_verdicts']:.1f} s | "
              f"{r['vs_one_seat']:.2f}x | {'yes' if r['every_verdict_right'] else 'NO'} | "
              f"{r['median_lab_start']:.1f} s | {r['machine_cpu_seconds']} |")
    print(f"left behind after the hub stopped: {hub.left_behind or 'nothing'}")
    result = {"bench": "hub", "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                          "load_at_start": machine.describe(), "uptime": load()},
              "date": time.strftime("%Y-%m-%d"), "rounds": rounds, "left_behind": hub.left_behind}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
