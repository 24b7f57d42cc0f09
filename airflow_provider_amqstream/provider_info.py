"""Provider metadata: the single source of truth for what Airflow discovers."""

from __future__ import annotations

from typing import Any

from airflow_provider_amqstream import __version__


def _field(label: str, description: str, type_: str, default: Any = None, **schema: Any) -> dict[str, Any]:
    # Airflow 3.3's form shows no placeholder on an extra field; a string field with
    # ``examples`` gets a hint and offers them as suggestions, which is the closest thing.
    sch: dict[str, Any] = {"type": [type_, "null"], **schema}
    if default is not None:
        sch["default"] = default
    return {"label": label, "description": description, "schema": sch}


CONN_FIELDS: dict[str, dict[str, Any]] = {
    "hosts": _field("Failover brokers", "Brokers tried in order, as comma-separated host:port "
                    "(e.g. mq1.example.com:61613,mq2.example.com:61613). When set, it replaces Broker host(s), "
                    "which can also list several hosts itself. Leave empty for one broker.", "string",
                    examples=["mq1.example.com:61613,mq2.example.com:61613"]),
    "tls": _field("TLS", "Speak STOMP over TLS (stomp+ssl connector). A stomp+ssl:// URI means TLS too.",
                  "boolean", False),
    # No ``examples`` on the file fields: the form would say "Start typing to see options"
    # where there are no options to see, only a path to type.
    "ca_file": _field("CA file", "PEM file with the CA that signed the broker certificate, e.g. "
                      "/etc/amqstream/ca.pem. Empty: the system's CAs.", "string"),
    "cert_file": _field("Client certificate", "PEM client certificate for mutual TLS, e.g. "
                        "/etc/amqstream/client-cert.pem.", "string"),
    "key_file": _field("Client key", "PEM private key for the client certificate, e.g. "
                       "/etc/amqstream/client-key.pem. Empty: the key is in the certificate file.", "string"),
    "check_hostname": _field("Check hostname", "Verify the broker certificate matches the host name. Off, the "
                             "certificate must still be signed by the CA file.", "boolean", True),
    "heartbeat_ms": _field("Heart-beat (ms)", "STOMP heart-beat interval both ways; 0 disables.",
                           "integer", 10000, minimum=0),
    "chunk_size": _field("Chunk size (bytes)", "Default bytes per chunk message (1-4 MiB is best).",
                         "integer", 1048576, minimum=1, maximum=8388608),
    # None is the choice "none": the form saves no string for it (Airflow's masker warns
    # about every string extra shorter than 5 characters as a secret too short to mask).
    # The default is auto, as for a connection without the key. values_display names
    # each, or the form would offer a literal "null".
    "compression": _field("Compression", "Per-chunk compression for streams sent through this connection: auto "
                          "compresses chunks that shrink to half or less (CSV, JSON, logs) and stops trying on data "
                          "that does not; zstd tries every chunk; none sends every chunk as is. Receivers need no "
                          "setting.", "string", "auto", enum=[None, "auto", "zstd"],
                          values_display={"null": "none (send chunks as they are)",
                                          "auto": "auto (compress chunks that shrink: CSV, JSON, logs)",
                                          "zstd": "zstd (try every chunk)"}),
    "window": _field("Window (chunks)", "Chunks a sender sends per broker confirmation (handshake mode: "
                     "ahead of the slowest receiver).",
                     "integer", 16, minimum=1, maximum=1024),
    "connect_timeout": _field("Connect timeout (s)", "Seconds to wait for a broker to accept the STOMP "
                              "connection before trying the next one or failing.", "number", 15.0,
                              exclusiveMinimum=0),
    "receipt_timeout": _field("Receipt timeout (s)", "Seconds to wait for the broker to confirm a stored "
                              "message before the connection is treated as lost.", "number", 60.0,
                              exclusiveMinimum=0),
    "network": _field("Network of brokers", "The broker is one of a network of brokers: a trigger watching for "
                      "offers also draws those waiting at the other brokers to this one.", "boolean", False),
    "vhost": _field("Virtual host", "The STOMP host header, if the broker wants one other than the broker's "
                    "host name.", "string"),
    # What the streams page and `amqstream streams ls` show (hooks/streams.py reads them).
    "destinations": _field("Destinations", "Destinations the streams page and `amqstream streams ls` show, "
                           "comma-separated, e.g. /queue/orders,/queue/invoices.", "string"),
    "out_dirs": _field("Receivers' directories", "Receivers' output directories this machine can read, "
                       "comma-separated, for the streams in progress and incomplete batches, e.g. "
                       "/data/landing/orders.", "string"),
    "quarantine": _field("Quarantine queue", "The quarantine queue the receivers were given, if not "
                         "/queue/DLQ.<name> for each destination.", "string"),
    "receivers": _field("Receiving users", "The broker users your receivers log in as, comma-separated, "
                        "besides this connection's own, e.g. rx-orders,rx-invoices: redrive and the streams page "
                        "believe the quarantine copies these users filed, and no other user's.", "string"),
    "records_retention_days": _field("Records retention (days)", "Days receivers keep the record of each stream "
                                     "they published (and senders of each stream sent). Older records are "
                                     "pruned: a stream offered again after that is received again. 0 keeps "
                                     "them for ever.", "number", 30.0, minimum=0),
    # Sealed streams (docs/protocol.md, "Sealed streams").
    "seal_to": _field("Seal to (recipients)", "Senders seal every stream for these recipients, comma-separated "
                      "amqs1... strings as `amqstream keys show KEYFILE` prints them: the broker then holds nothing "
                      "readable of a file.", "string"),
    "keys": _field("Key files", "Receivers open sealed streams with these private key files, comma-separated "
                   "paths (several for key rotation), e.g. /etc/amqstream/landing.key.", "string"),
    "seal": {
        "label": "Sealing",
        "description": "required: senders refuse to send without a recipient, receivers quarantine unsealed "
                       "streams.",
        "schema": {"type": ["string", "null"], "enum": [None, "required"], "default": None,
                   "values_display": {"null": "optional", "required": "required"}},
    },
    "min_rate": _field("Minimum rate (bytes/s)", "Bytes a second a stream must bring to keep a receiver: a "
                       "stream sent more slowly, or stopped half-way, gives way (parked, tried again later) "
                       "instead of holding the streams behind it. 0 waits the idle timeout.", "number", 16384,
                       minimum=0),
}


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-amqstream",
        "name": "ActiveMQ Stream",
        "description": "Move files of any size through Apache ActiveMQ, chunked over STOMP, "
                       "resumable after any crash, and hand them to PySpark.",
        "versions": [__version__],
        "integrations": [{"integration-name": "ActiveMQ Stream", "tags": ["protocols"]}],
        "hooks": [{"integration-name": "ActiveMQ Stream",
                   "python-modules": ["airflow_provider_amqstream.hooks.amqstream"]}],
        "operators": [{"integration-name": "ActiveMQ Stream",
                       "python-modules": ["airflow_provider_amqstream.operators.stream",
                                          "airflow_provider_amqstream.operators.receive",
                                          "airflow_provider_amqstream.operators.spark"]}],
        "sensors": [{"integration-name": "ActiveMQ Stream",
                     "python-modules": ["airflow_provider_amqstream.sensors.stream"]}],
        "triggers": [{"integration-name": "ActiveMQ Stream",
                      "python-modules": ["airflow_provider_amqstream.triggers.stream",
                                         "airflow_provider_amqstream.triggers.offered"]}],
        "asset-uris": [{"schemes": ["amqstream"],
                        "handler": "airflow_provider_amqstream.assets.amqstream.sanitize_uri",
                        "factory": "airflow_provider_amqstream.assets.amqstream.create_asset",
                        "to_openlineage_converter":
                            "airflow_provider_amqstream.assets.amqstream.convert_asset_to_openlineage"}],
        # Needs apache-airflow-providers-common-messaging (extra "messaging"); without it
        # Airflow logs the feature as unavailable and skips it.
        "queues": ["airflow_provider_amqstream.queues.amqstream.AmqStreamMessageQueueProvider"],
        # No "plugins" here: the streams page is the airflow.plugins entry point (pyproject.toml),
        # which Airflow loads in either [core] lazy_discover_providers setting. Named here too, it
        # would be found twice with that setting off, and a name found twice is an import error
        # (and, in Task SDK 1.3.2, drops every plugin after it in task processes).
        "connection-types": [{
            "hook-class-name": "airflow_provider_amqstream.hooks.amqstream.AmqStreamHook",
            "hook-name": "ActiveMQ Stream (STOMP)",
            "connection-type": "amqstream",
            "ui-field-behaviour": {
                "hidden-fields": ["schema"],
                "relabeling": {"host": "Broker host(s)", "login": "User", "port": "STOMP port"},
                "placeholders": {"host": "127.0.0.1 or mq1.example.com,mq2.example.com",
                                 "port": "61613", "login": "amqstream"},
            },
            "conn-fields": CONN_FIELDS,
        }],
    }
