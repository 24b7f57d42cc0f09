"""The protocol's vocabulary: header names, message kinds, modes and limits.

Header names are valid JMS identifiers, so ``amqs_stream = 'x'`` works as a selector
(docs/protocol.md lists each header and who writes it).
"""

from __future__ import annotations

from enum import Enum

PROTOCOL_VERSION = 1
# STOMP's registered port: here, the one layer both the transport and the embedded broker
# may import (they are independent siblings).
DEFAULT_PORT = 61613
H_VERSION = "amqs_version"
H_KIND = "amqs_kind"
H_STREAM = "amqs_stream"
H_MODE = "amqs_mode"
H_NAME = "amqs_name"
H_SIZE = "amqs_size"
H_CHUNK_SIZE = "amqs_chunk_size"
H_CHUNKS = "amqs_chunks"
H_DATA_DEST = "amqs_data_dest"
H_SEQ = "amqs_seq"
H_OFFSET = "amqs_offset"
H_CRC = "amqs_crc32"
H_SHA256 = "amqs_sha256"
H_ENCODING = "amqs_encoding"
H_REPLY_TO = "amqs_reply_to"
H_WINDOW = "amqs_window"
H_REOFFER = "amqs_reoffer"
# Optional: the subdirectory of the receiver's output directory the file goes to, relative,
# components separated by "/" (a directory send keeps its tree).
H_DIR = "amqs_dir"
H_CONSUMER = "amqs_consumer"
H_NEXT_SEQ = "amqs_next_seq"
# Who made the stream: a digest of the sender's file identity and destination. A stream id
# names a stream; the origin tells a repeat of it from another stream that reused the id.
H_ORIGIN = "amqs_origin"
# Handshake mode: a receiver's secret for one stream, sent only on the control queue (which
# other receivers cannot read), so the sender can tell its receiver from an impostor.
H_TOKEN = "amqs_token"
# A pack (see bulk.py): its members' stream ids as "|a|b|", for the LIKE in
# offer_selector.
H_PACK_IDS = "amqs_pack_ids"
# Added by a receiver that quarantines a stream, on the copy of its offer it files away.
H_QUARANTINE_REASON = "amqs_quarantine_reason"
H_QUARANTINED_FROM = "amqs_quarantined_from"
H_QUARANTINED_BY = "amqs_quarantined_by"
H_QUARANTINED_AT = "amqs_quarantined_at"
# A yielded stream's offer, put back at the tail of its queue by a receiver: not taken
# before this time (epoch seconds), how often it yielded, and who offered it first.
H_NOT_BEFORE = "amqs_not_before"
H_YIELDS = "amqs_yields"
H_YIELD_REASON = "amqs_yield_reason"
H_FIRST_SENDER = "amqs_first_sender"
# Where a stream's partial data is: a note a receiver leaves on Destination.held_queue
# before it takes any chunk, naming its host, output directory and partial file, so a
# receiver elsewhere (a retry on another worker) can say where the first bytes went.
H_HELD_HOST = "amqs_held_host"
H_HELD_DIR = "amqs_held_dir"
H_HELD_PART = "amqs_held_part"
H_HELD_SINCE = "amqs_held_since"
# Standard JMS group properties: a plain JMS consumer can reassemble with these alone.
H_GROUP_ID = "JMSXGroupID"
H_GROUP_SEQ = "JMSXGroupSeq"
# The sender as the broker authenticated it, stamped on every message by a broker with
# populateJMSXUserID and useAuthenticatedPrincipalForJMSXUserID (the shipped config); ActiveMQ
# 5.17 shows it on STOMP MESSAGE frames under this name. Read it with sender_of only.
H_USER_ID = "JMSXUserID"
# Our user names are at most 64 characters; an external broker's (a JAAS principal) may be
# longer. A longer stamp is treated as none, not cut: a cut name could be another user's.
MAX_USER_ID = 256
DEFAULT_CHUNK_SIZE = 1024 * 1024
DEFAULT_WINDOW = 16
# Receiver batch: half the broker's page size (maxPageSize=16 in the shipped config).
DEFAULT_RECEIVE_BATCH = 8
# ActiveMQ's STOMP connector refuses frames over maxDataLength (9 MiB in our config: the
# largest chunk and its headers, and no more: a receiver may be handed several frames of
# that size before it can refuse any, and the broker pages in 16 per destination; 32 MiB
# chunks from a send-only user ran the shipped broker out of heap).
MAX_CHUNK_SIZE = 8 * 1024 * 1024
MAX_STREAM_ID = 128
MAX_NAME_BYTES = 255
# How far past the first missing chunk a chunk may be. Delivery reorders within a few
# prefetch windows; further ahead is a sender playing games (each chunk ahead of a gap is
# kept in the resume state, which is rewritten every batch).
MAX_AHEAD = 1024
# Set by the transport (frames.py) on a frame whose header section it had to cut; the
# transport does not import the protocol, so frames.py spells the name out.
H_TRUNCATED = "amqs_truncated"


class Kind(str, Enum):
    OFFER = "offer"
    DATA = "data"
    END = "end"
    # Receiver -> sender, handshake mode only; each carries amqs_consumer and amqs_next_seq.
    HELLO = "hello"
    ACK = "ack"
    REREQ = "rereq"
    DONE = "done"
    # Sender -> receivers, on the destination after a batch's offers: its file list.
    BATCH = "batch"
    # Sender -> receivers, on the destination: several inline offers in one message.
    PACK = "pack"


CONTROL_KINDS = frozenset({Kind.HELLO, Kind.ACK, Kind.REREQ, Kind.DONE})


class Mode(str, Enum):
    """When the receiver may see a stream.

    ``stream``: the offer goes first, so a receiver can write while the sender sends.
    ``atomic``: the offer goes last, after the broker confirmed every chunk, so no
    receiver ever starts on a stream whose producer died (a transaction,
    without holding the stream in broker memory: chunks wait in KahaDB).
    ``handshake``: the sender waits for receivers to answer the offer and paces itself
    by their acknowledgements; required for topics.
    """

    STREAM = "stream"
    ATOMIC = "atomic"
    HANDSHAKE = "handshake"
