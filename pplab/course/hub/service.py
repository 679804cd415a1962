"""The room's page as a service of the workshop's hub: behind the hub's login, for its instructors.

The hub starts it (`c.JupyterHub.services`, see `pplab.course.hub.configure`) with the room's folder and
tells it where to listen and how to reach the hub (JUPYTERHUB_* variables). A browser that is not
logged in is sent to the hub's login page; a user without the instructors' role
(`access:services!service=pplab-room`) is refused by the hub (403). It serves what `pplab room`
serves on loopback: the page, /room.json and /grades.csv.

    python -m pplab.course.hub.service FOLDER [--refresh SECONDS]
"""

from __future__ import annotations

import argparse
import os
import secrets
from urllib.parse import urlparse

ACCESS = "behind the hub's login: the instructors' role alone can open it"


def make_app(folder: str, refresh: float):
    """The tornado application of the service, under the prefix the hub proxies to it."""
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
    from tornado import web

    from pplab.course.room_page import room_response

    class RoomHandler(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self, path: str) -> None:
            status, kind, body = room_response(folder, "/" + path, refresh, ACCESS)
            self.set_status(status)
            self.set_header("Content-Type", kind)
            self.set_header("Cache-Control", "no-store")  # an instructor's page, never a shared cache's
            self.finish(body)

    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/pplab-room/")
    return web.Application([(prefix + "oauth_callback", HubOAuthCallbackHandler),
                            (prefix + "(.*)", RoomHandler)],
                           cookie_secret=secrets.token_bytes(32))


def main(argv: list[str] | None = None) -> int:
    """Serve the room until the hub stops the service."""
    from tornado import ioloop

    parser = argparse.ArgumentParser(prog="python -m pplab.course.hub.service",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the room's folder")
    parser.add_argument("--refresh", type=float, default=3.0, help="seconds between the page's re-reads")
    args = parser.parse_args(argv)
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:8765"))
    make_app(args.folder, args.refresh).listen(url.port or 80, url.hostname or "127.0.0.1")
    print(f"pplab room service: {args.folder} on {url.geturl()}, {ACCESS}", flush=True)
    try:
        ioloop.IOLoop.current().start()
    except KeyboardInterrupt:  # the hub's Ctrl-C reaches its services too: a quiet stop
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
