"""Reading AIRFLOW_CONN_<ID> without Airflow: the same fields Airflow itself would read."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_amqstream.hooks import connection as c
from airflow_provider_amqstream.transport.params import BrokerParams


def _airflow_fields(value: str, conn_id: str = "x") -> dict[str, object]:
    """What Airflow's Task SDK makes of the same text (the reference we must match)."""
    from airflow.sdk.definitions.connection import Connection

    conn = Connection.from_json(value, conn_id=conn_id) if value.lstrip().startswith("{") else \
        Connection.from_uri(value, conn_id=conn_id)
    return {"conn_type": conn.conn_type, "host": conn.host or None, "port": conn.port, "login": conn.login,
            "password": conn.password, "schema": conn.schema or None, "extra": conn.extra_dejson}


def _ours(value: str, conn_id: str = "x") -> dict[str, object]:
    f = c.parse_connection(value, conn_id)
    return {"conn_type": f.conn_type, "host": f.host, "port": f.port, "login": f.login, "password": f.password,
            "schema": f.schema, "extra": dict(f.extra)}


SAMPLES = [
    "amqstream://amqstream:s3cret@127.0.0.1:61613",
    "amqstream://us%40er:p%40ss%2Fw%3Ard%25x@mq.example.com:61614?heartbeat_ms=5000&tls=true",
    "amqstream://u:p@mq1,mq2:61613?hosts=mq1%3A61613%2Cmq2%3A61614&window=32",
    "amqstream://u:p@host:1/vhost?__extra__=%7B%22tls%22%3A+true%2C+%22window%22%3A+8%7D",
    "amqstream://u:p@HOST.Example:61613?empty=&compression=zstd",
    "amqstream://[::1]:61613",
    "amqstream://host",
    "amqstream-x://host:5",
    '{"conn_type": "amqstream", "host": "mq1", "port": 61613, "login": "u", "password": "p@ss",'
    ' "extra": {"tls": true, "window": 8}}',
    '{"conn_type": "amqstream", "host": "mq1", "port": "61613", "extra": "{\\"heartbeat_ms\\": 0}"}',
    '  {"host": "h", "schema": "s"}  ',
]


@pytest.mark.parametrize("value", SAMPLES)
def test_parsing_matches_airflow(value: str) -> None:
    assert _ours(value) == _airflow_fields(value)


@settings(max_examples=60, deadline=None)
@given(login=st.text(min_size=1, max_size=12), password=st.text(min_size=1, max_size=24),
       port=st.integers(1, 65535))
def test_percent_encoded_credentials_match_airflow(login: str, password: str, port: int) -> None:
    uri = f"amqstream://{quote(login, safe='')}:{quote(password, safe='')}@mq.local:{port}?window=4"
    ours = _ours(uri)
    assert ours == _airflow_fields(uri)
    assert (ours["login"], ours["password"], ours["port"]) == (login, password, port)


def test_uri_query_becomes_extra_and_reaches_the_broker_params() -> None:
    f = c.parse_uri("amqstream://u:p%3Aw@mq1:61613?hosts=mq1%3A61613%2Cmq2%3A61614&tls=true&window=32", "x")
    params = f.broker_params()
    assert params.hosts == (("mq1", 61613), ("mq2", 61614))
    assert params.tls is True and params.window == 32
    assert (params.login, params.password) == ("u", "p:w")


def test_dunder_extra_holds_the_extra_as_json() -> None:
    extra = json.dumps({"tls": True, "check_hostname": False, "window": 8})
    f = c.parse_uri(f"amqstream://u:p@h:1?__extra__={quote(extra)}", "x")
    assert dict(f.extra) == {"tls": True, "check_hostname": False, "window": 8}
    assert f.broker_params().check_hostname is False


def test_json_extra_as_a_string_and_as_an_object_mean_the_same() -> None:
    as_obj = c.parse_json('{"host": "h", "port": 5, "extra": {"heartbeat_ms": 0, "tls": "true"}}', "x")
    as_str = c.parse_json(json.dumps({"host": "h", "port": 5, "extra": json.dumps({"heartbeat_ms": 0, "tls": "true"})}),
                          "x")
    assert as_obj == as_str
    assert as_obj.broker_params().heartbeat_ms == 0 and as_obj.broker_params().tls


def test_env_var_name_is_the_upper_cased_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MY_MQ", '{"conn_type": "amqstream", "host": "mq9", "port": 7}')
    f = c.from_env("my_mq")
    assert f is not None and (f.host, f.port) == ("mq9", 7)
    assert c.from_env("other") is None
    assert c.from_env("my_mq", environ={}) is None


@pytest.mark.parametrize(("value", "fragment"), [
    ('{"host": "h", "password": "hunter2", "port": "eighty"}', "integer port"),
    ('{"host": "h", "password": "hunter2", "extra": "{not json"}', "extra is not valid JSON"),
    ('{"host": "h", "password": "hunter2", "extra": "[1, 2]"}', "JSON object"),
    ('{"host": "h", "password": "hunter2",', "not valid JSON"),
    ("amqstream://u:hunter2@h:99999", "port is not a number"),
    ("amqstream://u:hunter2@h:hunter2", "port is not a number"),
    ("amqstream://u:hunter2@mq1:61613,mq2:61614", "?hosts=mq1:61613,mq2:61614"),
    # A password with a character that ends the authority: urllib would read part of it as
    # the port, path or query and quote it back.
    ("amqstream://u:hun#ter2@h:61613", "percent-encoded"),
    ("amqstream://u:hun/ter2@h:61613", "percent-encoded"),
    ("amqstream://u:hun?ter2@h:61613", "percent-encoded"),
    ("amqstream://u:hunter2@h:1?__extra__=nope", "extra is not valid JSON"),
    ("u:hunter2@h", "not a connection URI"),
    ("   ", "is empty"),
])
def test_bad_values_name_the_variable_never_the_password(monkeypatch: pytest.MonkeyPatch, value: str,
                                                         fragment: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_BAD", value)
    with pytest.raises(ValueError) as err:
        c.from_env("bad")
    assert fragment in str(err.value) and "AIRFLOW_CONN_BAD" in str(err.value)
    assert "hunter2" not in str(err.value) and "ter2" not in str(err.value)


def test_missing_connection_says_what_to_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_AMQS_NOWHERE", raising=False)
    with pytest.raises(c.ConnectionNotFound) as err:
        c.resolve("amqs_nowhere")
    msg = str(err.value)
    assert "AIRFLOW_CONN_AMQS_NOWHERE=" in msg and "airflow connections add amqs_nowhere" in msg


def test_default_connection_falls_back_to_the_embedded_broker(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", raising=False)
    monkeypatch.setenv("AMQSTREAM_BROKER_DIR", str(tmp_path))
    with pytest.raises(c.ConnectionNotFound):
        c.resolve(None)  # never started here: nothing to fall back to
    (tmp_path / "broker.port").write_text("61999\n")
    (tmp_path / "credentials.json").write_text('{"user": "admin", "password": "pw"}')
    params, source = c.resolve(None)
    assert params.hosts == (("127.0.0.1", 61999),) and params.login == "admin"
    assert "embedded broker" in source


def test_resolve_prefers_a_uri_then_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", "amqstream://a:b@envhost:1")
    assert c.resolve(None)[0].hosts == (("envhost", 1),)
    assert c.resolve("amqstream://x:y@urihost:2")[0].hosts == (("urihost", 2),)
    assert c.resolve(None)[1] == "$AIRFLOW_CONN_AMQSTREAM_DEFAULT"


def test_hook_reads_the_variable_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

    monkeypatch.setenv("AIRFLOW_CONN_AMQS_HOOKED", json.dumps(
        {"conn_type": "amqstream", "host": "mq1", "port": 61613, "login": "u", "password": "p@ss",
         "extra": json.dumps({"hosts": "mq1:61613,mq2:61614", "receipt_timeout": "7"})}))
    params = AmqStreamHook("amqs_hooked").broker_params()
    assert params == c.from_env("amqs_hooked").broker_params()  # type: ignore[union-attr]
    assert params.hosts == (("mq1", 61613), ("mq2", 61614)) and params.receipt_timeout == 7.0
    assert isinstance(params, BrokerParams) and params.password == "p@ss"


def test_a_custom_secrets_backend_is_asked_first_as_airflow_does(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQS_SHADOWED", "amqstream://a:b@envhost:1")
    monkeypatch.delenv("AIRFLOW__SECRETS__BACKEND", raising=False)
    monkeypatch.delenv("AIRFLOW__WORKERS__SECRETS_BACKEND", raising=False)
    cfg = tmp_path / "airflow.cfg"
    monkeypatch.setenv("AIRFLOW_CONFIG", str(cfg))
    assert c.from_env("amqs_shadowed") is not None  # no airflow.cfg: nothing configured
    cfg.write_text("[secrets]\nbackend = my.vault.Backend\nbackend_kwargs = {\"x\": \"%(y)s\"}\n")
    assert c.custom_secrets_backend() == "my.vault.Backend"
    assert c.from_env("amqs_shadowed") is None  # defer to Airflow, which asks the backend first
    cfg.write_text("[core]\nload_examples = False\n")
    monkeypatch.setenv("AIRFLOW__WORKERS__SECRETS_BACKEND", "other.Backend")
    assert c.from_env("amqs_shadowed") is None


def test_seal_extras_are_parsed_once_and_a_bad_recipient_names_the_connection(tmp_path: Path) -> None:
    from airflow_provider_amqstream.cli import main
    from airflow_provider_amqstream.exceptions import ConfigurationError

    key = tmp_path / "rx.key"
    assert main(["keys", "new", str(key)]) == 0
    from airflow_provider_amqstream.engine.keys import read_key_file

    rcpt = read_key_file(key).recipient
    params = BrokerParams.from_parts("h", None, None, None, {"seal_to": f"{rcpt}, {rcpt}", "keys": [str(key)],
                                                              "seal": "required"}, where="conn x")
    assert params.seal_to == (rcpt, rcpt) and params.keys == (str(key),) and params.seal_required
    assert not BrokerParams.from_parts("h", None, None, None, {}).seal_required
    with pytest.raises(ConfigurationError, match="conn x.*seal_to.*recipient"):
        BrokerParams.from_parts("h", None, None, None, {"seal_to": rcpt[:-1]}, where="conn x")
    with pytest.raises(ConfigurationError, match="'seal' must be"):
        BrokerParams.from_parts("h", None, None, None, {"seal": "yes"}, where="conn x")
