"""The Airflow page of the streams: ``amqstream streams`` in the UI (Browse > ActiveMQ streams).

An Airflow 3 plugin: a FastAPI app mounted by the API server under ``/amqstream`` and an
external view that shows its page inside the UI (an iframe the UI sandboxes with
``allow-same-origin``, so the page's requests carry the user's Airflow session).

* ``GET /amqstream/streams``: the page (``streams.html``, no external assets).
* ``GET /amqstream/streams/api/connections``: the ``amqstream`` connections the user may
  read, with the destinations each lists (its ``destinations`` extra) and whether the user
  may act on it.
* ``GET /amqstream/streams/api/inventory?conn_id=&destination=``: what ``streams ls`` shows.
* ``GET /amqstream/streams/api/show?conn_id=&destination=&stream_id=``: ``streams show``.
* ``POST /amqstream/streams/api/redrive`` and ``/discard`` with JSON ``{conn_id,
  destination, stream_id}``: the actions.

Airflow does not authenticate plugin apps: every route here does, with Airflow's own
reading of the session (``get_user``: the bearer token, else the session cookie), and asks
the auth manager: reading a connection's streams needs ``GET`` on the connection, redrive
and discard need ``PUT`` (edit). The actions also need a JSON body, which a cross-site form
cannot send. The broker is never called on the event loop: each call runs in a small pool
of threads with a time-out (a slow or absent broker answers 504, and takes at most the pool's
threads, never the API server's), and no chunk is read (docs: engine/inventory.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from importlib import resources
from typing import Any, Literal, TypeVar

from airflow.sdk.plugins_manager import AirflowPlugin
from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse

from airflow_provider_amqstream.exceptions import (
    AccessDenied,
    AmqStreamError,
    ConnectionNotFound,
    StreamError,
    TransportError,
)
from airflow_provider_amqstream.hooks.streams import AmqStreamAdminHook

log = logging.getLogger(__name__)

URL_PREFIX = "/amqstream"
# A broker that does not answer within this costs the page a 504, not a hung worker.
VIEW_TIMEOUT = 20.0
ACTION_TIMEOUT = 600.0
CONNECT_TIMEOUT = 5.0
# Broker calls run here, never on the API server's event loop; a handful is plenty for a
# page, and a dead broker can tie up no more than these.
# Made on first use: a pool made at import would live in every Airflow process that loads
# plugins (task processes too), not only the API server. Only the event loop asks for it: no lock.
@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="amqs-streams-ui")


_T = TypeVar("_T")
# The last look per (connection, destination), for the rates of streams in progress.
_MARKS: OrderedDict[tuple[str, str], dict[str, tuple[int, float]]] = OrderedDict()
_MAX_MARKS = 64
_MARKS_LOCK = threading.Lock()

app = FastAPI(title="ActiveMQ streams", docs_url=None, redoc_url=None, openapi_url=None)


async def _in_thread(fn: Callable[[], _T], timeout: float, what: str) -> _T | JSONResponse:
    """Run ``fn`` in the pool; the provider's own refusals come back as a response saying why."""

    def run() -> _T | JSONResponse:
        try:
            return fn()
        except AmqStreamError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=next(
                (code for cls, code in _STATUS if isinstance(exc, cls)), 400))

    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(_pool(), run), timeout)
    except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
        raise HTTPException(504, f"{what}: no answer within {timeout:.0f}s (is the broker slow or unreachable?)") \
            from None


async def _user(request: Request) -> Any:
    """The caller as Airflow's API knows it (a bearer token, else the session cookie)."""
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.security import HTTPAuthorizationCredentials

    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip()) \
        if scheme.lower() == "bearer" and token.strip() else None
    return await get_user(request, None, creds)


# Reading a connection's streams is GET on it, acting on them PUT (Airflow's ResourceMethod).
_Method = Literal["GET", "PUT"]


def _may(user: Any, conn_id: str, method: _Method) -> bool:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    return bool(get_auth_manager().is_authorized_connection(method=method, details=ConnectionDetails(conn_id=conn_id),
                                                            user=user))


async def _allowed(request: Request, conn_id: str, method: _Method) -> Any:
    user = await _user(request)
    if not _may(user, conn_id, method):
        what = "read" if method == "GET" else "edit"
        raise HTTPException(403, f"you may not {what} connection {conn_id!r}, so not its streams either")
    return user


def _hook(conn_id: str) -> AmqStreamAdminHook:
    return AmqStreamAdminHook(conn_id, connect_timeout=CONNECT_TIMEOUT)


def connection_ids() -> list[str]:
    """Every ``amqstream`` connection Airflow knows: ``AIRFLOW_CONN_*`` variables of that type,
    then the metadata database's."""
    from airflow_provider_amqstream.hooks import connection

    found = []
    for name, value in os.environ.items():
        if not name.startswith(connection.ENV_PREFIX):
            continue
        conn_id = name[len(connection.ENV_PREFIX):].lower()
        try:
            fields = connection.parse_connection(value, conn_id, name)
        except (AmqStreamError, ValueError):
            continue
        if str(fields.conn_type or "").lower() in connection.SCHEMES:
            found.append(conn_id)
    try:
        from airflow.models.connection import Connection
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            found += list(session.scalars(select(Connection.conn_id).where(
                Connection.conn_type.in_(list(connection.SCHEMES)))))
    except Exception as exc:  # no metadata database here: the variables are all there is
        log.warning("amqstream connections in the metadata database not listed: %s", exc)
    return sorted(set(found))


# The HTTP status of each of the provider's refusals, first match; any other is 400.
_STATUS: tuple[tuple[type[AmqStreamError], int], ...] = (
    (AccessDenied, 403),  # the broker refused the connection's user
    (ConnectionNotFound, 404),
    (StreamError, 409),  # the stream is not in a state the action can help (the text says why)
    (TransportError, 502),  # the broker is unreachable or failed
)


@app.get("/streams", response_class=HTMLResponse)
async def page(request: Request) -> HTMLResponse:
    await _user(request)
    html = resources.files(__package__).joinpath("streams.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


@app.get("/streams/api/connections")
async def connections(request: Request) -> Any:
    user = await _user(request)

    def listing() -> list[dict[str, Any]]:
        out = []
        for conn_id in connection_ids():
            if not _may(user, conn_id, "GET"):
                continue
            entry: dict[str, Any] = {"conn_id": conn_id, "can_edit": _may(user, conn_id, "PUT")}
            try:
                hook = _hook(conn_id)
                entry["destinations"] = hook.destinations()
                entry["out_dirs"] = hook.out_dirs()
            except Exception as exc:  # a broken connection is listed, with why
                entry.update(destinations=[], out_dirs=[], error=str(exc))
            out.append(entry)
        return out

    return await _in_thread(listing, VIEW_TIMEOUT, "listing the amqstream connections")


@app.get("/streams/api/inventory")
async def inventory(request: Request, conn_id: str, destination: str) -> Any:
    await _allowed(request, conn_id, "GET")
    key = (conn_id, destination)

    def look() -> Any:
        from airflow_provider_amqstream.engine.partials import progress_marks

        with _MARKS_LOCK:
            previous = _MARKS.get(key)
        inv = _hook(conn_id).inventory(destination, previous=previous)
        with _MARKS_LOCK:
            _MARKS[key] = progress_marks(inv.in_progress)
            _MARKS.move_to_end(key)
            while len(_MARKS) > _MAX_MARKS:
                _MARKS.popitem(last=False)
        return inv.to_json()

    return await _in_thread(look, VIEW_TIMEOUT, f"looking at {destination} through {conn_id}")


@app.get("/streams/api/show")
async def show(request: Request, conn_id: str, destination: str, stream_id: str) -> Any:
    await _allowed(request, conn_id, "GET")
    return await _in_thread(lambda: _hook(conn_id).show(destination, stream_id).to_json(), VIEW_TIMEOUT,
                            f"looking at stream {stream_id} on {destination}")


async def _action(request: Request, body: Any, verb: str) -> tuple[str, str, str]:
    """An action's (connection, destination, stream id), once its caller may edit the
    connection; logged with who asked."""
    # A cross-site form can only send form or text bodies; JSON needs a script of this origin.
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, "send the action as application/json")
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) and body.get(k) for k in (
            "conn_id", "destination", "stream_id")):
        raise HTTPException(422, "send JSON {conn_id, destination, stream_id}")
    conn_id, destination, stream_id = body["conn_id"], body["destination"], body["stream_id"]
    user = await _allowed(request, conn_id, "PUT")
    log.info("%s of stream %s on %s through %s asked by %s", verb, stream_id, destination, conn_id,
             getattr(user, "get_name", lambda: "?")())
    return conn_id, destination, stream_id


@app.post("/streams/api/redrive")
async def redrive(request: Request, body: Any = Body(...)) -> Any:  # noqa: B008 - FastAPI's way
    conn_id, destination, stream_id = await _action(request, body, "redrive")
    t0 = time.monotonic()
    result = await _in_thread(lambda: _hook(conn_id).redrive(destination, stream_id).to_json(),
                              ACTION_TIMEOUT, f"redriving stream {stream_id} on {destination}")
    log.info("redrive of stream %s: %.1fs", stream_id, time.monotonic() - t0)
    return result


@app.post("/streams/api/discard")
async def discard(request: Request, body: Any = Body(...)) -> Any:  # noqa: B008 - FastAPI's way
    conn_id, destination, stream_id = await _action(request, body, "discard")
    return await _in_thread(lambda: _hook(conn_id).discard(destination, stream_id).to_json(),
                            ACTION_TIMEOUT, f"discarding stream {stream_id} on {destination}")


class AmqStreamPlugin(AirflowPlugin):
    """Registers the streams page: the FastAPI app and its place in the UI's Browse menu."""

    name = "amqstream_streams"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "ActiveMQ streams"}]
    external_views = [{
        "name": "ActiveMQ streams",
        # Relative: the UI resolves it against its base URL, so a deployment under a path works.
        "href": URL_PREFIX.lstrip("/") + "/streams",
        "url_route": "amqstream-streams",
        "destination": "nav",
        "category": "browse",
    }]
