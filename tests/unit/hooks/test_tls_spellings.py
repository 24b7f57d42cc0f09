"""Issue "One URI parser": every spelling of TLS gives TLS or is refused, never plain text.

No broker here: what each spelling parses to, through the one parser every source shares
(``--conn``, ``AIRFLOW_CONN_*`` as URI or JSON, the hook). tests/integration/test_tls_wire.py runs the
same spellings through the real command line against a real plaintext port.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from urllib.parse import quote

import pytest

from airflow_provider_amqstream.exceptions import TransportError
from airflow_provider_amqstream.hooks import connection as c
from airflow_provider_amqstream.transport.connection import tls_context
from airflow_provider_amqstream.transport.params import BrokerParams

SECRET = "pw-S3cr3t"
AUTH = f"u:{SECRET}@mq.example.com:61614"


def _extra(obj: object) -> str:
    return quote(json.dumps(obj))


# (spelling, connection text) -> True: TLS.
TLS_ON = [
    ("stomp+ssl scheme", f"stomp+ssl://{AUTH}"),
    ("amqstream+ssl scheme", f"amqstream+ssl://{AUTH}"),
    ("tls=true", f"amqstream://{AUTH}?tls=true"),
    ("tls=1", f"amqstream://{AUTH}?tls=1"),
    ("tls=TRUE", f"amqstream://{AUTH}?tls=TRUE"),
    ("tls=yes", f"amqstream://{AUTH}?tls=yes"),
    ("tls=on", f"amqstream://{AUTH}?tls=on"),
    ("__extra__ tls true", f"amqstream://{AUTH}?__extra__={_extra({'tls': True})}"),
    ("__extra__ tls 'true'", f"amqstream://{AUTH}?__extra__={_extra({'tls': 'true'})}"),
    ("__extra__ tls 1", f"amqstream://{AUTH}?__extra__={_extra({'tls': 1})}"),
    ("stomp scheme with tls=true", f"stomp://{AUTH}?tls=true"),
    ("stomp+ssl with tls=true", f"stomp+ssl://{AUTH}?tls=true"),
    ("stomp+ssl with __extra__ null tls", f"stomp+ssl://{AUTH}?__extra__={_extra({'tls': None})}"),
    ("tls with ca_file", f"amqstream://{AUTH}?tls=true&ca_file=%2Fetc%2Fca.pem"),
    ("JSON extra object", json.dumps({"conn_type": "amqstream", "host": "mq1", "password": SECRET,
                                      "extra": {"tls": True}})),
    ("JSON extra string", json.dumps({"conn_type": "amqstream", "host": "mq1", "password": SECRET,
                                      "extra": json.dumps({"tls": True})})),
    ("JSON extra 'true'", json.dumps({"conn_type": "amqstream", "host": "mq1", "extra": {"tls": "true"}})),
    ("JSON stomp+ssl type", json.dumps({"conn_type": "stomp+ssl", "host": "mq1", "password": SECRET})),
    ("JSON without conn_type", json.dumps({"host": "mq1", "extra": {"tls": 1}})),
]

# -> False: plain text, and nothing in them asks for TLS.
TLS_OFF = [
    ("amqstream scheme", f"amqstream://{AUTH}"),
    ("stomp scheme", f"stomp://{AUTH}"),
    ("tls=false", f"amqstream://{AUTH}?tls=false"),
    ("tls=0", f"amqstream://{AUTH}?tls=0"),
    ("__extra__ tls false", f"amqstream://{AUTH}?__extra__={_extra({'tls': False})}"),
    ("JSON extra tls false", json.dumps({"conn_type": "amqstream", "host": "mq1", "extra": {"tls": False}})),
    ("JSON no extra", json.dumps({"conn_type": "amqstream", "host": "mq1"})),
]

# -> refused, with a fragment of the error.
REFUSED = [
    ("stomp+ssl with tls=false", f"stomp+ssl://{AUTH}?tls=false", "the scheme asks for TLS but the extra tls is false"),
    ("amqstream+ssl with tls=0", f"amqstream+ssl://{AUTH}?tls=0", "the scheme asks for TLS but the extra tls is false"),
    ("stomp+ssl with __extra__ false", f"stomp+ssl://{AUTH}?__extra__={_extra({'tls': False})}",
     "the scheme asks for TLS"),
    ("tls=maybe", f"amqstream://{AUTH}?tls=maybe", "extra 'tls' must be true or false, got 'maybe'"),
    ("tls=ture", f"stomp+ssl://{AUTH}?tls=ture", "extra 'tls' must be true or false, got 'ture'"),
    ("tls= (empty)", f"amqstream://{AUTH}?tls=", "extra 'tls' must be true or false, got ''"),
    ("__extra__ tls 'maybe'", f"amqstream://{AUTH}?__extra__={_extra({'tls': 'maybe'})}",
     "must be true or false"),
    ("__extra__ tls 2", f"amqstream://{AUTH}?__extra__={_extra({'tls': 2})}", "must be true or false, got '2'"),
    ("__extra__ tls list", f"amqstream://{AUTH}?__extra__={_extra({'tls': [True]})}", "must be true or false"),
    ("ssl=true", f"amqstream://{AUTH}?ssl=true", "extra 'ssl' is not an amqstream setting"),
    ("ssl=false", f"amqstream://{AUTH}?ssl=false", "extra 'ssl' is not an amqstream setting"),
    ("TLS=true", f"amqstream://{AUTH}?TLS=true", "extra 'TLS' is not an amqstream setting"),
    ("use_ssl=true", f"amqstream://{AUTH}?use_ssl=true", "extra 'use_ssl' is not an amqstream setting"),
    ("use-tls=1", f"amqstream://{AUTH}?use-tls=1", "extra 'use-tls' is not an amqstream setting"),
    ("__extra__ ssl true", f"amqstream://{AUTH}?__extra__={_extra({'ssl': True})}", "'ssl' is not an amqstream"),
    ("ca_file without tls", f"amqstream://{AUTH}?ca_file=%2Fetc%2Fca.pem", "ca_file given but TLS is off"),
    ("cert_file with tls=false", f"amqstream://{AUTH}?tls=false&cert_file=%2Fc.pem&key_file=%2Fk.pem",
     "cert_file, key_file given but TLS is off"),
    ("stomp+nio+ssl scheme", f"stomp+nio+ssl://{AUTH}", "'stomp+nio+ssl' is not an amqstream one"),
    ("ssl scheme", f"ssl://{AUTH}", "'ssl' is not an amqstream one"),
    ("stomp+tls scheme", f"stomp+tls://{AUTH}", "'stomp+tls' is not an amqstream one"),
    ("amqstream-ssl scheme", f"amqstream-ssl://{AUTH}", "'amqstream_ssl' is not an amqstream one"),
    ("http scheme", f"http://{AUTH}", "'http' is not an amqstream one"),
    ("Airflow protocol form", "amqstream://stomp+ssl://mq.example.com:61614", "starts with a scheme (stomp+ssl://)"),
    ("JSON stomp+ssl with tls false", json.dumps({"conn_type": "stomp+ssl", "host": "mq1", "password": SECRET,
                                                  "extra": {"tls": False}}), "the scheme asks for TLS"),
    ("JSON extra string tls maybe", json.dumps({"conn_type": "amqstream", "host": "mq1", "password": SECRET,
                                                "extra": json.dumps({"tls": "maybe"})}), "got 'maybe'"),
    ("JSON ssl key", json.dumps({"conn_type": "amqstream", "host": "mq1", "extra": {"ssl": True}}),
     "'ssl' is not an amqstream setting"),
    ("JSON other conn_type", json.dumps({"conn_type": "generic", "host": "mq1", "password": SECRET}),
     "'generic' is not an amqstream one"),
    ("JSON host with scheme and password", json.dumps({"conn_type": "amqstream", "host": f"stomp+ssl://u:{SECRET}@mq1"}),
     "starts with a scheme"),
]


def _ids(cases: list[tuple[str, ...]]) -> list[str]:
    return [case[0] for case in cases]


@pytest.mark.parametrize(("name", "value"), TLS_ON, ids=_ids(TLS_ON))
def test_tls_spellings_give_tls(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQS_TLS_SPELLING", value)
    from_env = c.from_env("amqs_tls_spelling")
    assert from_env is not None
    assert from_env.broker_params().tls is True
    if "://" in value:
        assert c.params_from_uri(value).tls is True
    params, _ = c.resolve(value)  # --conn, URI or JSON
    assert params.tls is True and params.url.startswith("stomp+ssl://")


@pytest.mark.parametrize(("name", "value"), TLS_OFF, ids=_ids(TLS_OFF))
def test_plain_spellings_give_plain_text(name: str, value: str) -> None:
    assert c.parse_connection(value, "x").broker_params().tls is False
    assert c.resolve(value)[0].tls is False


@pytest.mark.parametrize(("name", "value", "fragment"), REFUSED, ids=_ids(REFUSED))
def test_unclear_spellings_are_refused_naming_the_source_not_the_password(
        name: str, value: str, fragment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQS_TLS_BAD", value)
    with pytest.raises(ValueError) as from_env:
        c.from_env("amqs_tls_bad").broker_params()  # type: ignore[union-attr]
    with pytest.raises(ValueError) as from_conn:
        c.resolve(value)
    for err, source in ((from_env, "AIRFLOW_CONN_AMQS_TLS_BAD"), (from_conn, "--conn")):
        text = str(err.value)
        assert fragment in text and text.startswith(f"{source}: ")
        assert SECRET not in text


def test_an_unknown_scheme_error_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as err:
        c.params_from_uri("stomp+nio+ssl://mq1:61614")
    for scheme in c.SCHEMES:
        assert f"{scheme}://" in str(err.value)


@pytest.mark.parametrize(("value", "expected"), [
    (f"stomp+ssl://{AUTH}", True),
    (f"stomp+ssl://{AUTH}?check_hostname=true", True),
    (f"stomp+ssl://{AUTH}?check_hostname=false", False),
    (f"stomp+ssl://{AUTH}?check_hostname=0", False),
    (f"amqstream://{AUTH}?__extra__={_extra({'tls': True, 'check_hostname': False})}", False),
    (json.dumps({"conn_type": "amqstream", "host": "h", "extra": json.dumps({"tls": True, "check_hostname": False})}),
     False),
])
def test_check_hostname_is_read_from_every_form(value: str, expected: bool) -> None:
    assert c.parse_connection(value, "x").broker_params().check_hostname is expected


def test_check_hostname_that_is_not_clearly_a_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="extra 'check_hostname' must be true or false, got 'nah'"):
        c.params_from_uri(f"stomp+ssl://{AUTH}?check_hostname=nah")


def test_the_hook_reads_a_uri_with_the_same_parser() -> None:
    from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

    for _, value in TLS_ON:
        if "://" in value:
            assert AmqStreamHook(uri=value).broker_params() == c.params_from_uri(value)
    with pytest.raises(ValueError, match="the hook's uri: the scheme asks for TLS"):
        AmqStreamHook(uri=f"stomp+ssl://{AUTH}?tls=false").broker_params()


def test_the_hook_reads_the_variable_with_the_same_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

    monkeypatch.setenv("AIRFLOW_CONN_AMQS_HOOK_TLS", f"stomp+ssl://{AUTH}")
    assert AmqStreamHook("amqs_hook_tls").broker_params().tls is True
    monkeypatch.setenv("AIRFLOW_CONN_AMQS_HOOK_TLS", f"amqstream://{AUTH}?tls=maybe")
    with pytest.raises(ValueError, match="AIRFLOW_CONN_AMQS_HOOK_TLS: connection extra 'tls' must be"):
        AmqStreamHook("amqs_hook_tls").broker_params()


@pytest.mark.parametrize(("conn_type", "extra", "expected"), [
    ("stomp+ssl", None, True),
    ("amqstream", '{"tls": true}', True),
    ("amqstream", None, False),
    (None, '{"tls": "1"}', True),
])
def test_a_stored_airflow_connection_goes_through_the_same_reading(conn_type: str | None, extra: str | None,
                                                                   expected: bool) -> None:
    from airflow.sdk import Connection

    conn = Connection(conn_id="stored", conn_type=conn_type, host="mq1", port=61614, password=SECRET, extra=extra)
    assert c.from_airflow(conn, "connection 'stored'").broker_params().tls is expected


def test_a_stored_airflow_connection_with_tls_off_and_a_tls_scheme_is_refused() -> None:
    from airflow.sdk import Connection

    conn = Connection(conn_id="stored", conn_type="stomp+ssl", host="mq1", password=SECRET, extra='{"tls": false}')
    with pytest.raises(ValueError, match="connection 'stored': the scheme asks for TLS") as err:
        c.from_airflow(conn, "connection 'stored'").broker_params()
    assert SECRET not in str(err.value)


def test_flag_extras_other_than_tls_are_strict_too() -> None:
    with pytest.raises(ValueError, match="extra 'network' must be true or false"):
        BrokerParams.from_parts("h", None, None, None, {"network": "perhaps"})
    assert BrokerParams.from_parts("h", None, None, None, {"network": "on"}).network is True


# -- the TLS context the transport uses --------------------------------------------------

@pytest.mark.parametrize("check", [True, False])
def test_the_tls_context_checks_the_host_name_as_configured_and_always_the_chain(check: bool) -> None:
    ctx = tls_context(BrokerParams(tls=True, check_hostname=check))
    assert ctx.check_hostname is check
    assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_check_hostname_false_in_a_uri_reaches_the_tls_context() -> None:
    ctx = tls_context(c.params_from_uri(f"stomp+ssl://{AUTH}?check_hostname=false"))
    assert ctx.check_hostname is False and ctx.verify_mode == ssl.CERT_REQUIRED


def test_a_missing_ca_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(TransportError, match=f"cannot use ca_file {missing}: No such file"):
        tls_context(BrokerParams(tls=True, ca_file=str(missing)))
    with pytest.raises(TransportError, match="key_file is set without cert_file"):
        tls_context(BrokerParams(tls=True, key_file=str(missing)))
