"""Settings and sample data shared by the example DAGs, the demo and the benchmarks.

It lives beside the DAGs (Airflow puts the DAGs folder on the import path), and
.airflowignore keeps the DAG processor from parsing it as a DAG file. Nothing here touches
the network or a connection: parsing a DAG file stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

BASE = Path(os.environ.get("AMQSTREAM_EXAMPLE_DIR", "/tmp/amqstream-example"))
LANDING = Path(os.environ.get("AMQSTREAM_LANDING_DIR", str(BASE / "landing")))
RECEIVED = Path(os.environ.get("AMQSTREAM_RECEIVED_DIR", str(BASE / "received")))
PARQUET = Path(os.environ.get("AMQSTREAM_PARQUET_DIR", str(BASE / "parquet")))
DEMO_FILE = os.environ.get("AMQSTREAM_DEMO_FILE", str(BASE / "sales.csv"))
QUEUE = os.environ.get("AMQSTREAM_QUEUE", "/queue/amqstream.examples")
# Example 3's two sites: one broker for both by default; `make demo-sites` gives each site its
# own broker, bridged, and these name the connections to them.
SITE_A_CONN = os.environ.get("AMQSTREAM_SITE_A_CONN_ID", "amqstream_default")
SITE_B_CONN = os.environ.get("AMQSTREAM_SITE_B_CONN_ID", "amqstream_default")
# Where the provider's documentation is, for the DAGs' docs: the README of the checkout
# these examples come from.
README = str(Path(__file__).resolve().parents[2] / "README.md")


def write_sample_csv(path: str | Path, rows: int = 50_000, seed: int = 7) -> Path:
    """A realistic sales CSV with typed columns (ints, decimals, dates, text), streamed to disk."""
    import random
    from datetime import date, timedelta

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    regions = ["north", "south", "east", "west", "central"]
    products = ["widget", "gadget", "gizmo", "doohickey", "sprocket", "flange"]
    start = date(2026, 1, 1)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("order_id,order_date,region,product,quantity,unit_price,discount,customer\n")
        lines = []
        for i in range(1, rows + 1):
            d = start + timedelta(days=rnd.randrange(365))
            lines.append(f"{i},{d.isoformat()},{rnd.choice(regions)},{rnd.choice(products)},"
                         f"{rnd.randint(1, 50)},{rnd.uniform(1, 500):.2f},{rnd.choice([0, 0, 0.05, 0.1]):.2f},"
                         f"customer-{rnd.randrange(100_000):05d}\n")
            if len(lines) == 10_000:
                fh.writelines(lines)
                lines.clear()
        fh.writelines(lines)
    os.replace(tmp, out)
    return out
