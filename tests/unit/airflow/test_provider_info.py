"""What the connection form and Airflow's provider registry get from us."""

from __future__ import annotations

from typing import Any

from airflow_provider_amqstream.provider_info import CONN_FIELDS, get_provider_info
from airflow_provider_amqstream.transport.params import BrokerParams


def _schemas() -> dict[str, dict[str, Any]]:
    return {name: f["schema"] for name, f in CONN_FIELDS.items()}


def test_compression_none_is_saved_as_no_string() -> None:
    # The form saved "compression": "none", a 4-character string that
    # Airflow's masker warned about as a secret too short to mask, on every lookup.
    sch = _schemas()["compression"]
    assert sch["default"] == "auto"  # as for a connection without the key
    assert sch["enum"] == [None, "auto", "zstd"] and "none" not in sch["enum"]
    assert set(sch["values_display"]) == {"auto", "null", "zstd"}
    assert sch["values_display"]["null"].startswith("none")
    from airflow.sdk.definitions.param import Param

    rules = {k: v for k, v in sch.items() if k != "default"}
    for value in (None, "auto", "zstd"):
        Param(value, **rules).resolve(suppress_exception=False)

    # Each value means what it says, and so does a connection saved before ("none") or without the key.
    def parsed(extra: dict[str, Any]) -> str | None:
        return BrokerParams.from_parts("h", None, None, None, extra).compression

    assert parsed({"compression": None}) is None
    assert parsed({}) == "auto" and parsed({"compression": ""}) == "auto"
    assert parsed({"compression": "none"}) is None and parsed({"compression": "None"}) is None
    assert parsed({"compression": "auto"}) == "auto"
    assert parsed({"compression": "zstd"}) == "zstd"


def test_timeouts_have_fields_that_reach_the_transport() -> None:
    for name, default in (("connect_timeout", 15.0), ("receipt_timeout", 60.0)):
        field = CONN_FIELDS[name]
        assert field["label"] and field["description"] and field["schema"]["default"] == default
        assert field["schema"]["exclusiveMinimum"] == 0
    got = BrokerParams.from_parts("h", None, None, None, {"connect_timeout": "3.5", "receipt_timeout": 7})
    assert (got.connect_timeout, got.receipt_timeout) == (3.5, 7.0)


def test_failover_help_names_the_field_it_relates_to() -> None:
    info = get_provider_info()["connection-types"][0]
    host_label = info["ui-field-behaviour"]["relabeling"]["host"]
    help_text = CONN_FIELDS["hosts"]["description"]
    assert host_label in help_text and "after Host" not in help_text
    # What the help promises: the list replaces the host field.
    got = BrokerParams.from_parts("ignored", 61613, None, None, {"hosts": "a:1,b:2"})
    assert got.hosts == (("a", 1), ("b", 2))


def test_every_field_has_label_help_and_a_schema_airflow_accepts() -> None:
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    pm.initialize_providers_list()
    ours = pm.providers["airflow-provider-amqstream"]
    assert ours.data["connection-types"][0]["conn-fields"] == CONN_FIELDS  # passed Airflow's schema check
    for name, field in CONN_FIELDS.items():
        assert field["label"] and field["description"], name
    assert "airflow_provider_amqstream.queues.amqstream.AmqStreamMessageQueueProvider" in pm.queue_class_names


def test_login_refusal_has_one_period_before_our_advice() -> None:
    from airflow_provider_amqstream.transport.connection import refusal_reason

    msg = refusal_reason(BrokerParams(login="u"), ["User name [u] or password is invalid."])
    assert "invalid. Check" in msg and ".." not in msg


def test_free_text_fields_suggest_an_example_value() -> None:
    # The form's only hint on an extra field: ``examples`` on a string schema, which must
    # also pass the Param check Airflow runs on a saved connection.
    from airflow.sdk.definitions.param import Param

    schema = CONN_FIELDS["hosts"]["schema"]
    assert schema["examples"]
    Param(None, **schema).resolve(suppress_exception=False)
    Param(schema["examples"][0], **schema).resolve(suppress_exception=False)


def test_file_fields_offer_no_options_and_name_an_example_path() -> None:
    # With ``examples`` the form showed "Start typing to see options" in
    # the CA and certificate fields, where there is only a path to type.
    for name in ("ca_file", "cert_file", "key_file"):
        field = CONN_FIELDS[name]
        assert "examples" not in field["schema"], name
        assert "e.g. /etc/amqstream/" in field["description"], name
