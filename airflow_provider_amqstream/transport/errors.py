"""The transport's exceptions, and what the broker's ERROR frames become.

An ERROR frame is reduced to one line of text as it arrives; a session turns the lines
it has collected into one exception whose message names the broker, the destination
where ActiveMQ says it, and what to do about it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from airflow_provider_amqstream.exceptions import AccessDenied, DestinationFull, TransportError

if TYPE_CHECKING:
    from stomp.utils import Frame

    from airflow_provider_amqstream.transport.params import BrokerParams


def error_text(frame: Frame) -> str:
    """An ERROR frame as one line: its ``message`` header, and the first line of its body
    where that adds something."""
    body = frame.body.decode("utf-8", "replace") if isinstance(frame.body, bytes) else str(frame.body)
    msg = str(frame.headers.get("message", ""))
    detail = body.strip().splitlines()[0][:300] if body.strip() else ""
    if detail and detail not in msg:
        msg = f"{msg}: {detail}" if msg else detail
    return msg


def access_denied(params: BrokerParams, errors: list[str]) -> AccessDenied | None:
    """The broker's refusal of a destination to this user, if ``errors`` (the ERROR frames'
    texts so far) hold one."""
    denied = [e for e in errors if "not authorized" in e.lower()]
    if not denied:
        return None
    who = params.login or "(anonymous)"
    return AccessDenied(
        f"broker {params.url} refused user {who}: {'; '.join(denied)}. Grant the user this "
        f"destination (embedded broker: `amqstream users add {who} --send DEST` or `--receive DEST`, "
        "then restart it; otherwise an authorizationEntry in the broker's activemq.xml)."
    )


def cap_refusal(params: BrokerParams, text: str) -> DestinationFull:
    """ActiveMQ's refusal of a destination past a user's cap (``text``), said as what it caps:
    a sender's data queues or its quarantine destinations."""
    # ActiveMQ says: "The maxmimum number of destinations allowed (N) for the policy
    # queue://NAME.amqs.USER.> has already been reached."
    m = re.search(r"allowed \((\d+)\) for the policy (queue|topic)://(\S+?)\.amqs\.([^.\s]+)", text)
    many, where = (m.group(1), f" on /{m.group(2)}/{m.group(3)}") if m else ("its", "")
    who = params.login or "(anonymous)"
    if m and m.group(3).startswith("DLQ."):  # the cap on one sender's quarantine destinations
        dest, owner = f"/{m.group(2)}/{m.group(3).removeprefix('DLQ.')}", m.group(4)
        return DestinationFull(
            f"broker {params.url} refused user {who} a new quarantine destination for "
            f"{dest}: {many} quarantined streams of sender {owner} already hold chunks there (DLQ.{dest.split('/')[-1]}"
            f".amqs.{owner}.*, capped per sender at its max_waiting). Discard some of {owner}'s quarantined streams "
            f"(`amqstream streams ls --from {dest}` lists them, `amqstream streams discard ID --from {dest}` removes "
            "one; an emptied one goes a minute later), then try again; or the administrator raises the cap (embedded "
            f"broker: `amqstream users add {owner}` again with its grants and `--max-waiting N`, then restart the "
            "broker). Nothing confirmed was lost.")
    return DestinationFull(
        f"broker {params.url} refused user {who} a new data queue: {many} of its streams already wait{where} "
        "(the broker's maxDestinations for that user's data queues). Receivers must take some first (an emptied "
        "data queue goes a minute later), or the administrator raises the cap (embedded broker: `amqstream users "
        f"add {who}` again with its grants and `--max-waiting N`, which also gives it a new password, then restart "
        "the broker). Nothing confirmed was lost.")


def reported(params: BrokerParams, errors: list[str]) -> TransportError:
    """The broker's ERROR frames as one exception (each refused message brings its own
    frame with the same text: it is said once)."""
    errors = list(dict.fromkeys(errors))
    capped = next((cap_refusal(params, e) for e in errors if "number of destinations allowed" in e), None)
    if capped is not None:
        return capped
    full = next((e for e in errors if "ResourceAllocationException" in e), None)
    if full is not None:
        # ActiveMQ names it: "... to prevent flooding queue://NAME. See http://..."
        m = re.search(r"flooding (queue|topic)://(\S+?)\.?(\s|$)", full)
        where = f" to /{m.group(1)}/{m.group(2)}" if m else ""
        return DestinationFull(
            f"broker {params.url} refused messages{where} (ResourceAllocationException): the destination's "
            "memory limit, or the broker's, which every destination shares, stayed full through the broker's "
            "flow-control wait, so receivers are not taking messages (stopped, or slower than the senders). "
            "Nothing confirmed was lost; resume the receivers, or raise the memoryLimit on the broker (an "
            "external broker also needs expireMessagesPeriod=\"0\": docs/security.md).")
    return TransportError(f"broker {params.url} reported: {'; '.join(errors)}")
